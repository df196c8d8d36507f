#!/usr/bin/env bash
# Call 38 (1 x H200: ranks share the GPU; 2 x H200 were not lent): 7fe6f30 (moelink rebuilt alone), notify stamped at
# eight points. HT at 2x1 over ptr with MOELINK_HT_TRACE, 5 reps, at 4096 and 512 tokens:
# notify's points and the gap before the dispatch.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/tr"
STEPS="sweep" SWEEP="MOELINK_HT_TRACE=1" T_SWEEP_EACH=90 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 5" \
  BUDGET_S=100 OUT=$OUT/tr W=/tmp/w38r bash scripts/device/run.sh > /tmp/w38r.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w38r/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("2x1 ptr traced", r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"))
PY
grep -h "moelink trace: rank . notify" /tmp/w38r/sweep/sweep.log | sed 's/(moelink::internode::notify)//' | cut -c1-330 | tail -8
grep -h "moelink trace: rank 0 dispatch" /tmp/w38r/sweep/sweep.log | cut -c1-130 | tail -4
STEPS="sweep" SWEEP="MOELINK_HT_TRACE=1" T_SWEEP_EACH=60 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 3 --tokens 512" \
  BUDGET_S=70 OUT=$OUT/t W=/tmp/w38s bash scripts/device/run.sh > /tmp/w38s.log 2>&1
echo "== 512 tokens"
grep -h "moelink trace: rank . notify" /tmp/w38s/sweep/sweep.log | sed 's/(moelink::internode::notify)//' | cut -c1-330 | tail -6
