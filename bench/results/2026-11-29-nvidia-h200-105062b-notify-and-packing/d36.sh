#!/usr/bin/env bash
# Call 36 (1 x H200: ranks share the GPU; 2 x H200 were not lent): fd0967c, notify's prefix columns four per
# pass with loads in flight. ht_internode, internode_gpu, and the single-node ht tests at 2 ranks (the
# per-expert check is shared); HT at 2x1 over ptr with MOELINK_HT_TRACE (notify's span and points, the gap
# before the dispatch), untraced beside it; 2x2 over ptr (4 ranks on the GPU: several ranks per node, the
# multi-holder columns and packed fp32 partials).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/t2" "$OUT/tr" "$OUT/x22"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=170 OUT=$OUT/t W=/tmp/w36t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 NGPU=2 T_TESTS=120 BUDGET_S=130 OUT=$OUT/t2 W=/tmp/w36s \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked|ranks" | head -10
summ() {
python3 - "$1" "$2" <<'PY'
import json, glob, sys
tag, w = sys.argv[1], sys.argv[2]
for f in sorted(glob.glob(f"{w}/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print(tag, f.rsplit("-", 1)[-1], r.get("mode"), r.get("op"), r.get("dtype"), r.get("status"), r.get("num_sms"), "time %.1f" % r.get("time_us", -1),
              "cached", r.get("cached_us"), "rdma", r.get("rdma_bytes"), "nvl", r.get("nvl_bytes"), "match", r.get("matches_host"))
PY
}
STEPS="sweep" SWEEP="- MOELINK_HT_TRACE=1" T_SWEEP_EACH=80 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 5" \
  BUDGET_S=170 OUT=$OUT/tr W=/tmp/w36r bash scripts/device/run.sh > /tmp/w36r.log 2>&1
summ "2x1 ptr" /tmp/w36r
grep -h "moelink trace: rank 0 notify\|moelink trace: rank 0 dispatch" /tmp/w36r/sweep/sweep.log | cut -c1-330 | tail -6
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=110 SWEEP_ARGS="--mode ht --ranks 4 --topology 2x2 --transport ptr --reps 5" \
  BUDGET_S=120 OUT=$OUT/x22 W=/tmp/w36x bash scripts/device/run.sh > /tmp/w36x.log 2>&1
summ "2x2 ptr" /tmp/w36x
tail -3 /tmp/w36x/sweep/sweep.log
