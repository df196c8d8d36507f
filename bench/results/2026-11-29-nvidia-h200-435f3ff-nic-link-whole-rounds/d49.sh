#!/usr/bin/env bash
# Call 49 (1 x H200): call 48's soak failure, with the host layout's per-expert counts printed at the failure.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOELINK_JIT_CACHE=/tmp/jit49
run() {
  local name=$1; shift
  echo "== $name: $*"
  timeout 100 .device/moelink-stress soak --backend cuda --families ht,ht-cached --time-budget-s 25 --progress-s 100 "$@" > /tmp/s49-$name.log 2>&1; echo "rc=$?"
  grep -E "^soak|ERROR|failed dispatch|layout differed" /tmp/s49-$name.log | cut -c1-250 | head -10
}
run 2x2-ptr-32 --ranks 4 --topology 2x2 --transport ptr
run 2x1-ptr-512 --ranks 2 --topology 2x1 --transport ptr --t-max 512
run 2x2-ptr-32-ht --ranks 4 --topology 2x2 --transport ptr --families ht
