#!/usr/bin/env bash
# Call 72 (1 x H200): where moelink's LL combine spends its time with two ranks on one GPU (call 71: 63.6 us
# against DeepEP's 47.8 us, DeepEP told 36 SMs). Traced Rust bench at DeepEP's LL shape: thread mode (one
# process, 66 blocks a rank) at its default and at MOELINK_LL_SMS=33, then process mode under MPS at 50 %
# (33 blocks a rank), with --hook for send and receive apart. GPU-sharing figures.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s72; mkdir -p $S
B=.device/moelink
timeout -k 5 90 $B bench --backend cuda --mode ll --ranks 2 --topology 1x2 --reps 20 --ll-trace --json $S/thread-66.json > $S/thread-66.log 2>&1; echo "thread-66 rc=$?"
MOELINK_LL_SMS=33 timeout -k 5 90 $B bench --backend cuda --mode ll --ranks 2 --topology 1x2 --reps 20 --ll-trace --json $S/thread-33.json > $S/thread-33.log 2>&1; echo "thread-33 rc=$?"
for f in thread-66 thread-33; do echo "== $f"; grep -E "^ll " $S/$f.log; done
tar -C /tmp -czf $OUT/call72b.tgz s72
[ -n "${THREADS_ONLY:-}" ] && exit 0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps72p CUDA_MPS_LOG_DIRECTORY=/tmp/mps72l
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
timeout -k 5 90 env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 torchrun --standalone --nproc_per_node=2 \
    --no-python $B bench --process --backend cuda --ranks 2 --topology 1x2 --mode ll --reps 20 --ll-trace --hook \
    --json $S/mps-33.json > $S/mps-33.log 2>&1; echo "mps-33 rc=$?"
echo quit | nvidia-cuda-mps-control
for f in thread-66 thread-33 mps-33; do echo "== $f"; grep -E "^ll |send|recv|trace" $S/$f.log | head -30; done
tar -C /tmp -czf $OUT/call72.tgz s72
