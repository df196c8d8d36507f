#!/usr/bin/env bash
# Call 28 (2 x H200): 67492ca + two more trace points in the internode LL dispatch send (send_routed,
# send_built; send_stored = copies fenced): where each block's 45 us go. 2x1 over ptr.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=90 SWEEP_ARGS="--mode ll --ranks 2 --topology 2x1 --transport ptr --reps 20 --ll-trace" \
  BUDGET_S=100 OUT=$OUT/lli W=/tmp/w28 bash scripts/device/run.sh > /tmp/w28.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w28/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print(r.get("op"), r.get("status"), "time %.1f" % r.get("time_us", -1), "kernel", r.get("kernel_us"))
        for k in ("kernel_trace", "loop_dispatch_trace"):
            if k in r:
                print("   ", k, " ".join(f"{p['point']}={p['median_us']:.1f}/{p['last_us']:.1f}" + (f"[b0 {p['block0_us']:.1f}]" if p.get('block0_us') is not None else "") for p in r[k]))
PY
