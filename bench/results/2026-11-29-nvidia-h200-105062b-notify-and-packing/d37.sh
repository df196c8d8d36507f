#!/usr/bin/env bash
# Call 37 (1 x H200: ranks share the GPU; 2 x H200 were not lent): a3f89b1, notify with one loop body for
# every prefix column. ht_internode, internode_gpu; HT at 2x1 over ptr with MOELINK_HT_TRACE, 10 reps:
# notify's points and the gap before the dispatch.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/tr"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=170 OUT=$OUT/t W=/tmp/w37t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
STEPS="sweep" SWEEP="MOELINK_HT_TRACE=1" T_SWEEP_EACH=90 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 10" \
  BUDGET_S=100 OUT=$OUT/tr W=/tmp/w37r bash scripts/device/run.sh > /tmp/w37r.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w37r/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("2x1 ptr traced", r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"))
PY
grep -h "moelink trace: rank . notify" /tmp/w37r/sweep/sweep.log | sed 's/(moelink::internode::notify)//' | cut -c1-200
grep -h "moelink trace: rank 0 dispatch" /tmp/w37r/sweep/sweep.log | cut -c1-130
