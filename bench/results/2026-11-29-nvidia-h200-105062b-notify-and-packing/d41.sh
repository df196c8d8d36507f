#!/usr/bin/env bash
# Call 41 (1 x H200: ranks share the GPU; 2 x H200 were not lent): 105062b (moelink, ht, ht_internode,
# internode_gpu rebuilt). The single-node ht tests at 4 ranks on the GPU (the shared per-expert check),
# internode_gpu; HT at 2x1 over ptr, 10 reps, untraced.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/b"
STEPS="tests" TEST_BINS="moelink.test.ht moelink.test.internode_gpu" NGPU=4 T_TESTS=150 BUDGET_S=170 OUT=$OUT/t W=/tmp/w41t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=90 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 10" \
  BUDGET_S=100 OUT=$OUT/b W=/tmp/w41b bash scripts/device/run.sh > /tmp/w41b.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w41b/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("2x1 ptr", r.get("op"), r.get("dtype"), r.get("status"), r.get("num_sms"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "rdma", r.get("rdma_bytes"), "match", r.get("matches_host"), r.get("commit"))
PY
cp /tmp/w41b/sweep/sweep-1.json $OUT/b/ 2>/dev/null
