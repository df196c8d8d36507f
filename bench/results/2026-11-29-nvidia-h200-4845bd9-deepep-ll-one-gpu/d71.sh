#!/usr/bin/env bash
# Call 71 (1 x H200): the hostcost step with DeepEP's LL beside moelink (DeepEP told the largest of 48/42/36 SMs
# at which its own test_low_latency passes), then issue 29's LL across virtual nodes against one node, process
# mode, 2 processes under MPS at 50 % (GPU-sharing figures).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/s71
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=0 DEEPEP_LL_SMS="48 42 36" T_PYTHON=440 BUDGET_S=450 \
  OUT=/tmp/o71 W=/tmp/w71 bash scripts/device/run.sh 2>&1 | tail -n 60
cp -r /tmp/w71/python/. /tmp/s71/ 2>/dev/null; cp /tmp/o71/* /tmp/s71/ 2>/dev/null
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])')
export NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps71p CUDA_MPS_LOG_DIRECTORY=/tmp/mps71l
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
for v in "1x2 ptr" "2x1 ptr" "2x1 nvshmem" "1x2 ptr"; do
    set -- $v
    name=ll-$1-$2; [ -f /tmp/s71/$name.json ] && name=$name-again
    timeout -k 5 90 env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 torchrun --standalone --nproc_per_node=2 \
        --no-python .device/moelink bench --process --backend cuda --ranks 2 --topology $1 $([ $1 = 1x2 ] || echo --transport $2) --mode ll --reps 30 \
        --json /tmp/s71/$name.json > /tmp/s71/$name.log 2>&1
    echo "$name rc=$?"; grep -iE "dispatch|combine" /tmp/s71/$name.log | head -6
done
echo quit | nvidia-cuda-mps-control
tar -C /tmp -czf $OUT/call71.tgz s71
