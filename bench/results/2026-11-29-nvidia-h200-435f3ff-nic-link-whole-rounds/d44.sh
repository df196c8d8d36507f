#!/usr/bin/env bash
# Call 44 (1 x H200: ranks share the GPU): the working tree's NIC statistics in the HT trace.
# 1. ht_internode and internode_gpu (correctness after the transport change);
# 2. HT at 2x1 over the emulated NIC (50 GB/s, 8 NIC blocks), traced: where the time over the wire floor goes;
# 3. the Python host cost, 2 ranks sharing the GPU under MPS, moelink beside DeepEP (does DeepEP run so?).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/nic" "$OUT/py"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=200 OUT=$OUT/t W=/tmp/w44t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
STEPS="sweep" SWEEP="MOELINK_HT_TRACE=1" T_SWEEP_EACH=120 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --reps 3 --transport emu-nic:rate=50,reorder=0,nic-blocks=8" \
  BUDGET_S=130 OUT=$OUT/nic W=/tmp/w44n bash scripts/device/run.sh > /tmp/w44n.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w44n/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("emu-nic50 nb8 traced", r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
cp /tmp/w44n/sweep/sweep.log $OUT/nic/traces.log 2>/dev/null
python3 .dv/tracepoints.py /tmp/w44n/sweep/sweep.log send_end,fwd_end,recv_end,reduce_end,nic_first_put,nic_last_put,nic_end,nic_busy_us,nic_idle_us,nic_capped_us 3
python3 .dv/tracepoints.py /tmp/w44n/sweep/sweep.log chunk_staged,chunk_put,put_us,fwd_seen,fwd_copied,fwd_released,fwd_started,fwd_put,reduce_seen,reduce_wait_us 2
STEPS="python" PY_STEPS="hostcost" HOSTCOST_RANKS=2 HOSTCOST_REPEAT=1 BUDGET_S=260 T_PYTHON=250 OUT=$OUT/py W=/tmp/w44p \
  bash scripts/device/run.sh > /tmp/w44p.log 2>&1
tail -60 /tmp/w44p.log
cp /tmp/w44p/python/hostcost*.json /tmp/w44p/python/hostcost.log $OUT/py/ 2>/dev/null
grep -iE "error|Traceback|failed" /tmp/w44p/python/*.log | head -20
