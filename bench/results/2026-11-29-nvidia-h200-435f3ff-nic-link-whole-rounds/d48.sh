#!/usr/bin/env bash
# Call 48 (1 x H200): bisecting call 46/47's soak failure (pre-existing: 33edf39 fails the same). moelink-stress
# at 77a5030 + a diagnostic (does the GPU layout differ from the host's before the failing dispatch?).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOELINK_JIT_CACHE=/tmp/jit48
run() {
  local name=$1; shift
  echo "== $name: $*"
  timeout 100 .device/moelink-stress soak --backend cuda --families ht,ht-cached --time-budget-s 25 --progress-s 100 "$@" > /tmp/s48-$name.log 2>&1; echo "rc=$?"
  grep -E "^ht|^soak|ERROR|layout differed" /tmp/s48-$name.log | cut -c1-400 | head -8
}
run 2x2-ptr-512 --ranks 4 --topology 2x2 --transport ptr --t-max 512 --ht-round-tokens 96
run 2x2-ptr-32 --ranks 4 --topology 2x2 --transport ptr
run 1x4-512 --ranks 4 --t-max 512
run 2x1-ptr-512 --ranks 2 --topology 2x1 --transport ptr --t-max 512
run 2x2-ptr-512-seed2 --ranks 4 --topology 2x2 --transport ptr --t-max 512 --seed 2
