#!/usr/bin/env bash
# Call 35 (1 x H200: both ranks share the GPU; 2 x H200 were not lent): combine partials packed by size (a single holder's bf16 row, else fp32) and notify's
# trace. ht_internode and internode_gpu; HT at 2x1 over ptr with MOELINK_HT_TRACE (notify, the gap before the
# dispatch, the dispatch); HT at 2x1 over emu-nic at 50 GB/s with 8 NIC blocks.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/tr" "$OUT/nic" "$OUT/x22"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=180 BUDGET_S=200 OUT=$OUT/t W=/tmp/w35t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
summ() {
python3 - "$1" "$2" <<'PY'
import json, glob, sys
tag, w = sys.argv[1], sys.argv[2]
for f in sorted(glob.glob(f"{w}/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        wire = r.get("wire_bytes") or 0
        print(tag, r.get("mode"), r.get("op"), r.get("dtype"), r.get("status"), r.get("num_sms"), "time %.1f" % r.get("time_us", -1),
              "cached", r.get("cached_us"), "rdma", r.get("rdma_bytes"), "nvl", r.get("nvl_bytes"), "match", r.get("matches_host"))
PY
}
STEPS="sweep" SWEEP="- MOELINK_HT_TRACE=1" T_SWEEP_EACH=80 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --transport ptr --reps 5" \
  BUDGET_S=170 OUT=$OUT/tr W=/tmp/w35r bash scripts/device/run.sh > /tmp/w35r.log 2>&1
summ "2x1 ptr traced" /tmp/w35r
grep -h "moelink trace: rank 0 notify\|moelink trace: rank 0 dispatch\|moelink trace: rank 0 cached" /tmp/w35r/sweep/sweep.log | cut -c1-420 | tail -12
grep -h "moelink trace: rank 0 combine" /tmp/w35r/sweep/sweep.log | tail -1 | cut -c1-1500
cp /tmp/w35r/sweep/sweep.log $OUT/tr/trace.log 2>/dev/null
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=120 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --reps 5 --transport emu-nic:rate=50,reorder=0,nic-blocks=8" \
  BUDGET_S=130 OUT=$OUT/nic W=/tmp/w35n bash scripts/device/run.sh > /tmp/w35n.log 2>&1
summ "2x1 emu-nic50 nb8" /tmp/w35n
