#!/usr/bin/env bash
# Call 47 (1 x H200): call 46's soak failure (2x2 over the emulated NIC, rounds of 96 tokens: a sender-side
# per-expert count off in the second round) — this session's change or older? The same soak with the
# session's base (33edf39, .device/base/moelink-stress) and with 77a5030, then 77a5030 over ptr and over the
# emulated NIC without the small rounds. 40 s each, stopping at the first error.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOELINK_JIT_CACHE=/tmp/jit47
common="--backend cuda --ranks 4 --topology 2x2 --families ht,ht-cached --t-max 512 --time-budget-s 35 --progress-s 100"
run() {
  local name=$1 bin=$2; shift 2
  echo "== $name: $*"
  timeout 120 "$bin" soak $common "$@" > /tmp/s47-$name.log 2>&1; echo "rc=$?"
  grep -E "^ht|^soak|ERROR" /tmp/s47-$name.log | cut -c1-260 | head -6
}
run base-nic .device/base/moelink-stress --transport emu-nic:reorder=20,nic-blocks=2 --ht-round-tokens 96
run head-nic .device/moelink-stress --transport emu-nic:reorder=20,nic-blocks=2 --ht-round-tokens 96
run head-ptr .device/moelink-stress --transport ptr --ht-round-tokens 96
run head-nic-big .device/moelink-stress --transport emu-nic:reorder=20,nic-blocks=2
run base-ptr .device/base/moelink-stress --transport ptr --ht-round-tokens 96
