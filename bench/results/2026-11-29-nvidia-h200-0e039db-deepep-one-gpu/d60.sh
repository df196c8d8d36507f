#!/usr/bin/env bash
# Call 60 (1 x H200): can DeepEP run beside moelink with 2 processes sharing the GPU under MPS, each held to
# half the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50), NVSHMEM's PEs on one GPU (full MPG, no remote transport)?
# 1. DeepEP's test_low_latency.py against DeepEP, then against moelink (scripts/device/share_gpus: gloo, GPU r mod n)
# 2. python -m moelink.bench --host-cost --graph at 2 ranks, both systems
# 3. moelink bench --process over nvshmem, 2x1 (HT and LL)
# 4. DeepEP's test_intranode.py against DeepEP, then moelink (if time is left)
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS
left() { echo $((560 - (SECONDS - T0))); }
S=/tmp/s60; mkdir -p $S
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
unset CUDA_DEVICE_MAX_CONNECTIONS
export MOELINK_COMMIT=$(cat .dv/COMMIT60) MOELINK_TIMEOUT_MS=5000
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/moelink-*.whl
python3 -m pip install -q --no-index --no-deps --target /tmp/deepep-site .whl/deep_ep-*.whl
# the Python layer of this tree over the wheel's (the native module is the wheel's, 94191ab)
cp python/moelink/*.py /tmp/site/moelink/
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])')
export NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS daemon started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS daemon quit"' EXIT
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
mkdir -p /tmp/shim/deep_ep
printf 'from moelink import *  # noqa\nfrom moelink import Buffer, Config, EventOverlap, topk_idx_t  # noqa\n' > /tmp/shim/deep_ep/__init__.py
SHARE=$PWD/scripts/device/share_gpus
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; timeout "$limit" "$@" > "$S/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t))s"; }
(cd .whl/deepep-tests && MOELINK_SHARE_GPUS=1 PYTHONPATH=$SHARE:/tmp/deepep-site:/tmp/site MASTER_PORT=8381 \
  step ll-deepep 80 python3 test_low_latency.py --num-processes 2)
tail -5 $S/ll-deepep.log | cut -c1-300
(cd .whl/deepep-tests && MOELINK_SHARE_GPUS=1 PYTHONPATH=$SHARE:/tmp/shim:/tmp/site MASTER_PORT=8371 \
  step ll-moelink 80 python3 test_low_latency.py --num-processes 2)
tail -4 $S/ll-moelink.log | cut -c1-300
PYTHONPATH=/tmp/deepep-site:/tmp/site step hostcost 170 torchrun --standalone --local-ranks-filter 0 --nproc_per_node=2 \
  -m moelink.bench --host-cost --graph --json $S/hostcost.json
sed -n '/^moelink bench --host-cost/,$p' $S/hostcost.log | head -60
if [ "$(left)" -gt 150 ]; then
  step procbench-nvshmem 140 torchrun --standalone --nproc_per_node=2 --no-python .device/moelink bench --process --backend cuda \
    --ranks 2 --topology 2x1 --transport nvshmem --mode all --reps 10 --json $S/procbench-nvshmem.json
  grep -E "^(ht|ll)|error|Error" $S/procbench-nvshmem.log | cut -c1-220 | head -20
fi
for sys in deepep moelink; do
  l=$(left); [ "$l" -gt 70 ] || break
  pp=/tmp/deepep-site:/tmp/site; [ $sys = moelink ] && pp=/tmp/shim:/tmp/site
  (cd .whl/deepep-tests && MOELINK_SHARE_GPUS=1 PYTHONPATH=$SHARE:$pp MASTER_PORT=$((8390 + RANDOM % 100)) step ht-$sys $((l - 10)) python3 test_intranode.py --num-processes 2)
  grep -E "passed|Best|Error|assert" $S/ht-$sys.log | tail -6 | cut -c1-250
done
tar -C /tmp -czf $OUT/call60.tgz s60
