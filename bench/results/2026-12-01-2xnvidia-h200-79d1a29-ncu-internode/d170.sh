#!/usr/bin/env bash
# Call 170 (2 x H200, process mode, a GPU per rank; issue 29's "Nsight Compute on the GPU machine"): head =
# 79d1a29. Nsight Compute on rank 0 only (torchrun; rank 1 runs unprofiled) of the internode HT dispatch, 2
# NVSHMEM processes as 2x1 (NVLink standing in for RDMA), FP8, 24 SMs: warp states and per-instruction samples.
# --clock-control none (the clocks are left alone). Kernel replays make a peer-waiting kernel wait for an
# unprofiled peer, so the times are not usable; where the warps were sampled is.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s170; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
NCU=$(which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; $NCU --version 2>&1 | tail -1
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
export NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MOELINK_CACHE_DIR=/tmp/jit170
cat > /tmp/wrap.sh <<W
#!/usr/bin/env bash
if [ "\$LOCAL_RANK" = 0 ]; then
  exec $NCU --clock-control none --target-processes application-only --kernel-name-base function --kernel-name dispatch --launch-skip 2 --launch-count 2 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight --export $S/prof -f $PWD/.device/moelink "\$@"
else
  exec $PWD/.device/moelink "\$@"
fi
W
chmod +x /tmp/wrap.sh
timeout -k 10 220 torchrun --standalone --nproc_per_node=2 --no-python /tmp/wrap.sh bench --process --backend cuda --ranks 2 --topology 2x1 \
  --transport nvshmem --mode ht --dtype fp8 --reps 3 --warmup 1 --no-host-check --timeout-s 30 > $S/prof.log 2>&1
echo "profile rc=$? at $(el)"; grep -E "^ht |==PROF==|error" $S/prof.log | head -12
if [ -f $S/prof.ncu-rep ]; then
  $NCU --import $S/prof.ncu-rep --page details --csv > $S/details.csv 2> $S/details.err
  $NCU --import $S/prof.ncu-rep --page source --csv --print-source sass > $S/source.csv 2> $S/source.err
  echo "export done at $(el)"; wc -l $S/details.csv $S/source.csv; head -c 400 $S/source.err
  grep -E "Stall|Warp Cycles|Duration|Issued Warp|Active Warps" $S/details.csv | cut -c1-220 | head -30
  gzip -f $S/source.csv
fi
tar -C /tmp -czf $OUT/call170.tgz s170
