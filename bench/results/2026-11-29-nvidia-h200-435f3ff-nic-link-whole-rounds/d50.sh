#!/usr/bin/env bash
# Call 50 (1 x H200): the fix for the soak failure of calls 46-49 (the dispatch's expected-count copy left in
# the per-expert words, where a later call with more experts per rank counts its senders).
# 1. ht_internode built before the kernel fix (its new calls: fewer experts, then more) — expected to fail —
#    and after it, with internode_gpu; 2. soaks across virtual nodes: 2x2 over ptr and the emulated NIC
#    (rounds of 96 tokens, T <= 512), 2x1 over ptr; every family.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT/t" "$OUT/s"
echo "== before the fix"
STEPS="tests" TEST_BINS="moelink.test.ht_internode.before" T_TESTS=150 BUDGET_S=160 OUT=$OUT/t W=/tmp/w50b \
  bash scripts/device/run.sh > /tmp/w50b.log 2>&1
grep -hE "test result|FAILED|panicked|num_tokens_per_expert" /tmp/w50b.log /tmp/w50b/tests/*.log 2>/dev/null | cut -c1-300 | head -8
echo "== after"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=160 OUT=$OUT/t W=/tmp/w50t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
export MOELINK_JIT_CACHE=/tmp/jit50
soak() {
  local name=$1; shift
  echo "== soak $name: $*"
  timeout 150 .device/moelink-stress soak --backend cuda --progress-s 200 --json "$OUT/s/soak-$name.json" "$@" > /tmp/s50-$name.log 2>&1; echo "rc=$?"
  grep -E "^(ht|ll)|^soak|ERROR|layout differed" /tmp/s50-$name.log | cut -c1-250 | head -9
}
soak 2x2-ptr --ranks 4 --topology 2x2 --transport ptr --t-max 512 --ht-round-tokens 96 --time-budget-s 60
soak 2x2-nic --ranks 4 --topology 2x2 --transport emu-nic:reorder=20,nic-blocks=2 --t-max 512 --ht-round-tokens 96 --time-budget-s 60
soak 2x1-ptr --ranks 2 --topology 2x1 --transport ptr --t-max 512 --time-budget-s 45
