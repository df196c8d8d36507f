#!/usr/bin/env bash
# Call 70 (1 x H200): af0fa24. Why DeepEP's LL times out with two processes on one GPU (call 69: the runtime
# already reports the MPS share, 66 SMs, so the grid-size hypothesis is refuted). Variants of DeepEP's own
# test_low_latency, 2 processes under MPS, each stopped after 60 s (35 s for the debug one); MPS restarted between them.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s70; mkdir -p $S /tmp/w70
python3 -m pip install -q --no-index --no-deps --target /tmp/w70/deepep-site .whl/deep_ep-*.whl
cc -shared -fPIC -O2 -I/usr/local/cuda/include scripts/device/share_gpus/share_sms.c -o /tmp/w70/libshare_sms.so -ldl
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])')
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps70p CUDA_MPS_LOG_DIRECTORY=/tmp/mps70l
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
base=(env -u CUDA_DEVICE_MAX_CONNECTIONS NVSHMEM_HOME=$nv NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
      NVSHMEM_DISABLE_NCCL=1 MOELINK_SHARE_GPUS=1 PYTHONPATH=$PWD/scripts/device/share_gpus:/tmp/w70/deepep-site)
variant() {  # variant NAME SECONDS ENV...
    local name=$1 limit=$2; shift 2
    nvidia-cuda-mps-control -d
    echo "== $name: $*" > $S/$name.log
    local t0=$SECONDS
    (cd .whl/deepep-tests && timeout -k 5 $limit "${base[@]}" "$@" python3 test_low_latency.py --num-processes 2) >> $S/$name.log 2>&1
    local rc=$?
    echo "== rc=$rc after $((SECONDS - t0)) s" >> $S/$name.log
    echo quit | nvidia-cuda-mps-control; sleep 2
    pkill -9 -f test_low_latency.py; sleep 1
    printf '%-12s rc=%-4s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(grep -E 'passed|Dispatch \+ combine|timeout for|Error' $S/$name.log | head -1 | cut -c1-120)" | tee -a $S/summary.txt
}
# 1. a smaller grid: 36 SMs each (36 blocks), far inside the 66 MPS leaves each process
variant sms36 60 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 LD_PRELOAD=/tmp/w70/libshare_sms.so MOELINK_SHARE_GPUS_SMS=36
# 2. no MPS limit, each told 48 SMs (2 x 48 <= 132)
variant nolimit48 60 LD_PRELOAD=/tmp/w70/libshare_sms.so MOELINK_SHARE_GPUS_SMS=48
# 3. NVSHMEM's heap without CUDA VMM (cudaMalloc + IPC), as in call 69 otherwise
variant novmm 60 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 NVSHMEM_DISABLE_CUDA_VMM=1
# 4. NVSHMEM's own account of the transports and peers
variant debug 35 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 NVSHMEM_DEBUG=INFO NVSHMEM_DEBUG_SUBSYS=INIT,TRANSPORT,MEM
cat $S/summary.txt
tar -C /tmp -czf $OUT/call70.tgz s70
