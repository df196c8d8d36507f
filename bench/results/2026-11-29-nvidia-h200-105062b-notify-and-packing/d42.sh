#!/usr/bin/env bash
# Call 42 (1 x H200: ranks share the GPU; 2 x H200 were not lent): 8624361 (moelink and ht_internode rebuilt).
# ht_internode at the session's last kernel commit; HT at 2x1 over the emulated NIC at 50 GB/s, 8 NIC
# blocks, with the senders' chunk at 8 (default) and 16 tokens: how much of the FP8 dispatch's distance
# from the wire floor is the emulator's per-descriptor cost.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/nic"
STEPS="tests" TEST_BINS="moelink.test.ht_internode" T_TESTS=120 BUDGET_S=130 OUT=$OUT/t W=/tmp/w42t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
STEPS="sweep" SWEEP="- MOELINK_HT_SEND_CHUNK=16" T_SWEEP_EACH=100 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --reps 5 --transport emu-nic:rate=50,reorder=0,nic-blocks=8" \
  BUDGET_S=210 OUT=$OUT/nic W=/tmp/w42n bash scripts/device/run.sh > /tmp/w42n.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w42n/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("emu-nic50 nb8", f.rsplit("-", 1)[-1], r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
cp /tmp/w42n/sweep/sweep-*.json $OUT/nic/ 2>/dev/null
