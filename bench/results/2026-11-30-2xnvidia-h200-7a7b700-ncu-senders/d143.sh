#!/usr/bin/env bash
# Call 143 (2 x H200, process mode, a GPU per rank; issue 31), head = 7a7b700. Nsight Compute on rank 0 only
# (torchrun; rank 1 runs unprofiled): the HT dispatch at EP2 (FP8, 24 SMs), warp states and per-instruction
# samples, so that the senders' stall shows. --clock-control none (the clocks are left alone).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s143; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
which ncu > $S/ncu-path.txt 2>&1 || ls /opt/nvidia/nsight-compute/*/ncu >> $S/ncu-path.txt 2>&1
NCU=$(which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; $NCU --version 2>&1 | tail -1
cat > /tmp/wrap.sh <<W
#!/usr/bin/env bash
if [ "\$LOCAL_RANK" = 0 ]; then
  exec $NCU --clock-control none --target-processes application-only --kernel-name dispatch --launch-skip 4 --launch-count 4 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight --export $S/prof -f $PWD/.device/moelink "\$@"
else
  exec $PWD/.device/moelink "\$@"
fi
W
chmod +x /tmp/wrap.sh
timeout -k 10 200 torchrun --standalone --nproc_per_node=2 --no-python /tmp/wrap.sh bench --process --backend cuda --ranks 2 --mode ht \
  --dtype fp8 --reps 3 --warmup 1 --no-host-check --timeout-s 30 > $S/prof.log 2>&1
echo "profile rc=$? at $(el)"; grep -E "^ht |==PROF==|error" $S/prof.log | head -12
if [ -f $S/prof.ncu-rep ]; then
  $NCU --import $S/prof.ncu-rep --page details --csv > $S/details.csv 2> $S/details.err
  $NCU --import $S/prof.ncu-rep --page source --csv --print-source sass > $S/source.csv 2> $S/source.err
  echo "export done at $(el)"; wc -l $S/details.csv $S/source.csv; head -c 600 $S/source.err
  grep -E "Stall|Warp Cycles|Duration|Issued Warp|Active Warps" $S/details.csv | cut -c1-220 | head -40
fi
tar -C /tmp -czf $OUT/call143.tgz s143
