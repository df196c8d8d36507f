#!/usr/bin/env bash
# Call 45 (1 x H200: ranks share the GPU): the working tree after call 44's findings.
#  - whole rounds: ht_bytes_needed(4096) gave rounds of 4088 tokens, so every 4096-token call ran a last
#    round of one chunk after the whole first round drained and came back;
#  - the emulated NIC: a link clock (no credit while idle) and one system fence per descriptor.
# 1. ht_internode, internode_gpu, ll_internode_gpu; 2. HT 2x1 over ptr (10 reps); 3. over the emulated NIC at
# 50 GB/s, 8 NIC blocks (5 reps), then traced (3 reps); 4. moelink's Python host cost, 2 ranks sharing the GPU.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/b" "$OUT/py"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu moelink.test.ll_internode_gpu" T_TESTS=200 BUDGET_S=210 OUT=$OUT/t W=/tmp/w45t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
show() {
python3 - "$1" "$2" <<'PY'
import json, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print(sys.argv[2], r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
}
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=100 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --reps 10 --transport ptr" \
  BUDGET_S=110 OUT=$OUT/b W=/tmp/w45p bash scripts/device/run.sh > /tmp/w45p.log 2>&1
show /tmp/w45p "2x1 ptr"
cp /tmp/w45p/sweep/sweep-1.json $OUT/b/ptr-sweep.json 2>/dev/null
STEPS="sweep" SWEEP="- MOELINK_HT_TRACE=1" T_SWEEP_EACH=100 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --reps 5 --transport emu-nic:rate=50,reorder=0,nic-blocks=8" \
  BUDGET_S=210 OUT=$OUT/b W=/tmp/w45n bash scripts/device/run.sh > /tmp/w45n.log 2>&1
show /tmp/w45n "emu-nic50 nb8 (2: traced)"
cp /tmp/w45n/sweep/sweep-1.json $OUT/b/nic-sweep.json; cp /tmp/w45n/sweep/sweep-2.json $OUT/b/nic-traced-sweep.json
cp /tmp/w45n/sweep/sweep.log $OUT/b/nic-traces.log
python3 .dv/tracepoints.py /tmp/w45n/sweep/sweep.log send_end,fwd_end,recv_end,reduce_end,nic_first_put,nic_last_put,nic_end,nic_busy_us,nic_idle_us,nic_capped_us 2
python3 .dv/tracepoints.py /tmp/w45n/sweep/sweep.log chunk_staged,stage_us,put_us,fwd_seen,fwd_put,reduce_seen 1
STEPS="python" PY_STEPS="hostcost" HOSTCOST_RANKS=2 BUDGET_S=130 T_PYTHON=120 OUT=$OUT/py W=/tmp/w45y \
  bash scripts/device/run.sh > /tmp/w45y.log 2>&1
sed -n '/^moelink bench --host-cost/,$p' /tmp/w45y/python/hostcost.log | head -30
cp /tmp/w45y/python/hostcost.json $OUT/py/ 2>/dev/null
grep -E "Error|Traceback" /tmp/w45y/python/hostcost.log | head -5
