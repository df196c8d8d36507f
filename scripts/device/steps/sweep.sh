#!/usr/bin/env bash
# Step `sweep` of scripts/device/run.sh: the same `moelink bench` call (SWEEP_ARGS, default: HT at DeepEP's
# shapes on NGPU ranks, 20 reps) once per setting of SWEEP, a space-separated list of settings, each a
# comma-separated list of NAME=VALUE environment variables (the tuning and timing-experiment knobs of
# crates/moelink-cli/src/env.rs), or `-` for none. Writes sweep-<i>.json and sweep.log to $OUT and prints a
# table: per setting, each record's time (cached dispatch in parentheses).
#   STEPS=sweep SWEEP="- MOELINK_HT_DISPATCH_SEND_BLOCKS=12 MOELINK_HT_TIMING_EXPERIMENT=1" bash scripts/device/run.sh
set -uo pipefail
[ -n "${MOELINK_DEVICE_RUN:-}" ] || { echo "$0 is a step of scripts/device/run.sh: STEPS=sweep bash scripts/device/run.sh" >&2; exit 2; }
OUT=${OUT:-/tmp/moelink-out}
mkdir -p "$OUT"
args=${SWEEP_ARGS:-"--mode ht --ranks $MOELINK_TEST_RANKS --reps 20"}
settings=${SWEEP:--}
if [ -n "${DRY_RUN:-}" ]; then
    for s in $settings; do echo "sweep: would run [$s] $BIN bench $args"; done
    exit 0
fi
i=0
for s in $settings; do
    i=$((i + 1))
    envs=()
    [ "$s" != "-" ] && IFS=, read -r -a envs <<<"$s"
    echo "== sweep $i: ${s}" >>"$OUT/sweep.log"
    # shellcheck disable=SC2086 # args are words
    timeout "${T_SWEEP_EACH:-90}" env "${envs[@]}" "$BIN" bench $args --json "$OUT/sweep-$i.json" >>"$OUT/sweep.log" 2>&1
    echo "rc=$?" >>"$OUT/sweep.log"
done
python3 - "$OUT" "$settings" <<'PY'
import json, os, sys
out, settings = sys.argv[1], sys.argv[2].split()
print(f"{'setting':60} records: op dtype time_us (cached_us) correct")
for i, s in enumerate(settings, 1):
    path = os.path.join(out, f"sweep-{i}.json")
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        print(f"{s:60} no records")
        continue
    recs = data if isinstance(data, list) else data.get("records", [])
    cells = []
    for r in recs:
        t = r.get("time_us")
        c = r.get("cached_us")
        cell = f"{r.get('op')} {r.get('dtype')} {t:.1f}" if t is not None else f"{r.get('op')} {r.get('status')}"
        if c is not None:
            cell += f" ({c:.1f})"
        if r.get("correct") is False:
            cell += " WRONG"
        cells.append(cell)
    print(f"{s:60} " + "; ".join(cells))
PY
