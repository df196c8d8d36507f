#!/usr/bin/env bash
# Call 74 (1 x H200): the commit in .device/COMMIT. (1) Traces of moelink's LL in process mode, 2 processes under
# MPS at 50 %: one node (1x2), across virtual nodes (2x1 over ptr and nvshmem). (2) Thread mode, 2 ranks on the
# GPU at 33 blocks each, with the LL experiments that drop the combine's expert-row loads (no_loads) or send its
# stores to the own region (local_stores): what each part of the combine's send phase costs.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s74; mkdir -p $S
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])')
export NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps74p CUDA_MPS_LOG_DIRECTORY=/tmp/mps74l
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
for v in "1x2 -" "2x1 ptr" "2x1 nvshmem"; do
    set -- $v
    name=proc-$1-$2
    timeout -k 5 120 env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 torchrun --standalone --nproc_per_node=2 \
        --no-python .device/moelink bench --process --backend cuda --ranks 2 --topology $1 $([ $2 = - ] || echo --transport $2) \
        --mode ll --reps 20 --ll-trace --json $S/$name.json > $S/$name.log 2>&1
    echo "$name rc=$?"; grep -E "^ll " $S/$name.log
done
echo quit | nvidia-cuda-mps-control
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
for x in none no_loads local_stores no_loads,local_stores; do
    name=thread33-${x/,/+}
    env CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_LL_SMS=33 $([ $x = none ] || echo MOELINK_LL_EXPERIMENT=$x) timeout -k 5 90 \
        .device/moelink bench --backend cuda --mode ll --ranks 2 --topology 1x2 --reps 20 --ll-trace --json $S/$name.json > $S/$name.log 2>&1
    echo "$name rc=$?"; grep -E "^ll " $S/$name.log
done
python3 .dv/tracepoints_ll.py $S/*.json
tar -C /tmp -czf $OUT/call74.tgz s74
