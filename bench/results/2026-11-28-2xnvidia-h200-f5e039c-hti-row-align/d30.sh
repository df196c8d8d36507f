#!/usr/bin/env bash
# Call 30 (2 x H200): f5e039c, HT across nodes with rows and messages padded to 128-byte lines. ht_internode
# (2x2, 2x4, 4x2 virtual nodes against the host backend); A/B at 2x1 over ptr, 24 SMs (base c9d1e92); the
# head's per-role trace (MOELINK_HT_TRACE) at 24 SMs.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/ab" "$OUT/tr"
STEPS="tests" TEST_BINS="moelink.test.ht_internode" T_TESTS=120 BUDGET_S=140 OUT=$OUT/t W=/tmp/w30t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
STEPS="ab" AB_ROUNDS=3 AB_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 10" BUDGET_S=200 T_AB=190 \
  OUT=$OUT/ab W=/tmp/w30a bash scripts/device/run.sh 2>&1 | grep -E "^\||rc="
STEPS="sweep" SWEEP="MOELINK_HT_TRACE=1" T_SWEEP_EACH=80 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 5" \
  BUDGET_S=90 OUT=$OUT/tr W=/tmp/w30r bash scripts/device/run.sh > /tmp/w30r.log 2>&1
grep -h "moelink trace: rank 0" /tmp/w30r/sweep/sweep.log | tail -6 | cut -c1-1500
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=150 SWEEP_ARGS="--mode all --ranks 2 --topology 2x1 --transport emu-nic:rate=50,reorder=0 --reps 5" \
  BUDGET_S=160 OUT=$OUT/nic W=/tmp/w30n bash scripts/device/run.sh > /tmp/w30n.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w30n/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("emu-nic 50", r.get("mode"), r.get("op"), r.get("dtype"), r.get("status"), r.get("num_sms"), "time", r.get("time_us"), "cached", r.get("cached_us"), "rdma_bytes", r.get("rdma_bytes"), "match", r.get("matches_host"))
PY
tail -5 /tmp/w30n/sweep/sweep.log
