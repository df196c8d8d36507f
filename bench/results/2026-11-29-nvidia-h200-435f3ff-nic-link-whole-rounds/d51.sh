#!/usr/bin/env bash
# Call 51 (1 x H200: ranks share the GPU): HT 2x1 over the emulated NIC at 50 GB/s with 8, 16 and 24 NIC
# blocks (the link caps the rate; more blocks only take the emulator's own copy limit away), 5 reps each;
# then 16 blocks traced.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/b"
for nb in 8 16 24; do
  STEPS="sweep" SWEEP="-" T_SWEEP_EACH=100 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --reps 5 --transport emu-nic:rate=50,reorder=0,nic-blocks=$nb" \
    BUDGET_S=110 OUT=$OUT/b W=/tmp/w51-$nb bash scripts/device/run.sh > /tmp/w51-$nb.log 2>&1
  python3 - "$nb" <<'PY'
import json, glob, sys
for f in sorted(glob.glob(f"/tmp/w51-{sys.argv[1]}/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("emu-nic50 nb" + sys.argv[1], r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
  cp /tmp/w51-$nb/sweep/sweep-1.json $OUT/b/nic-nb$nb-sweep.json 2>/dev/null
done
STEPS="sweep" SWEEP="MOELINK_HT_TRACE=1" T_SWEEP_EACH=100 SWEEP_ARGS="--mode ht --ranks 2 --topology 2x1 --reps 3 --transport emu-nic:rate=50,reorder=0,nic-blocks=16" \
  BUDGET_S=110 OUT=$OUT/b W=/tmp/w51t bash scripts/device/run.sh > /tmp/w51t.log 2>&1
cp /tmp/w51t/sweep/sweep.log $OUT/b/nic-nb16-traces.log
python3 .dv/tracepoints.py /tmp/w51t/sweep/sweep.log send_end,fwd_end,recv_end,reduce_end,nic_first_put,nic_last_put,nic_end,nic_busy_us,nic_idle_us,nic_capped_us 1
