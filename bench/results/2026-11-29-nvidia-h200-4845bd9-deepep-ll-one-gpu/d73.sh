#!/usr/bin/env bash
# Call 73 (1 x H200): 90cde2b. Traces of moelink's LL in process mode (2 processes under MPS at 50 %), which
# 90cde2b reports from rank 0: one node (1x2) and across virtual nodes (2x1 over ptr and nvshmem).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s73; mkdir -p $S
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])')
export NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps73p CUDA_MPS_LOG_DIRECTORY=/tmp/mps73l
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
for v in "1x2 -" "2x1 ptr" "2x1 nvshmem"; do
    set -- $v
    name=ll-$1-$2
    timeout -k 5 120 env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 torchrun --standalone --nproc_per_node=2 \
        --no-python .device/moelink bench --process --backend cuda --ranks 2 --topology $1 $([ $2 = - ] || echo --transport $2) \
        --mode ll --reps 20 --ll-trace --json $S/$name.json > $S/$name.log 2>&1
    echo "$name rc=$?"; grep -E "^ll " $S/$name.log
done
echo quit | nvidia-cuda-mps-control
python3 .dv/tracepoints_ll.py $S/*.json
tar -C /tmp -czf $OUT/call73.tgz s73
