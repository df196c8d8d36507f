#!/usr/bin/env bash
# Step `ab` of scripts/device/run.sh: the same `moelink bench` calls with the base binary (.device/base/moelink,
# built by `BASE_REV=<rev> scripts/device/build.sh`) and this build's, alternating AB_ROUNDS times (default 3)
# so that the machine's drift falls on both. AB_ARGS (default: HT and LL at DeepEP's shapes on NGPU ranks, 30
# repetitions, with a 1xN topology when the ranks outnumber the GPUs) pass to both. Writes
# $OUT/ab-{base,head}-<round>.json and prints, per case, the median over rounds of each binary's time and head / base.
set -u
[ -n "${MOELINK_DEVICE_RUN:-}" ] || { echo "$0 is a step of scripts/device/run.sh: STEPS=ab bash scripts/device/run.sh" >&2; exit 2; }
rounds=${AB_ROUNDS:-3}
# More ranks than GPUs (NGPU above the GPUs there are): the bench needs a topology that says they share them.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
share=""
[ "$MOELINK_TEST_RANKS" -gt "${gpus:-0}" ] 2>/dev/null && share="--topology 1x$MOELINK_TEST_RANKS"
args=${AB_ARGS:-"--mode all --ranks $MOELINK_TEST_RANKS $share --reps 30"}
base=$BIN_DIR/base/moelink
if [ -n "${DRY_RUN:-}" ]; then echo "ab: would run $rounds rounds of 'bench $args' with the base binary and this one"; exit 0; fi
[ -x "$base" ] || { echo "ab: no base binary ($base): build with BASE_REV=<rev> scripts/device/build.sh and carry .device"; exit 1; }
mkdir -p "$OUT"
for i in $(seq 1 "$rounds"); do
    for which in base head; do
        bin=$base
        [ "$which" = head ] && bin=$BIN
        echo "--- round $i: $which"
        # shellcheck disable=SC2086 # args is a list of options
        "$bin" bench $args --json "$OUT/ab-$which-$i.json" || rc=$?
    done
done
python3 - "$OUT" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
times = {}
for which in ("base", "head"):
    for i in range(1, rounds + 1):
        try:
            recs = json.load(open(f"{out}/ab-{which}-{i}.json"))
        except Exception as e:
            print(f"ab: {which} round {i}: {e}")
            continue
        for r in recs:
            if r.get("status") != "ok" or "time_us" not in r:
                continue
            key = (r.get("mode"), r.get("op"), r.get("dtype"), r.get("routing"), r.get("tokens"), r.get("num_sms"))
            times.setdefault(key, {}).setdefault(which, []).append(r["time_us"])
            if r.get("cached_us") is not None:  # the dispatch again with its handle: a case of its own
                cached = (key[0], "cached " + str(key[1]), *key[2:])
                times.setdefault(cached, {}).setdefault(which, []).append(r["cached_us"])
print("| mode | op | dtype | routing | tokens | SMs | base us | head us | head/base |")
print("|---|---|---|---|---|---|---|---|---|")
for key, t in sorted(times.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
    b = statistics.median(t["base"]) if t.get("base") else float("nan")
    h = statistics.median(t["head"]) if t.get("head") else float("nan")
    print("| " + " | ".join(str(k) for k in key) + f" | {b:.1f} | {h:.1f} | {h / b:.3f} |")
PY
exit "${rc:-0}"
