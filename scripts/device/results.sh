#!/usr/bin/env bash
# Runs THERE (kind nvidia-h200-x4, carry [".device"]): the run that produces a results folder, in ~5 minutes.
#   tests    the HT and LL GPU tests (bitwise against the host backend) — before anything is timed
#   soak     HT soak at T <= 32 and T <= 1024 (SOAK_S seconds each)
#   tune     MOELINK_HT_REDUCE_LOAD_VECS in TUNE_VECS at DeepEP's HT shape (24 SMs)
#   roles    scripts/device/ht-roles.sh at the default split: each role's data movement taken away in turn
#   chunks   HT at DeepEP's shape, 24 SMs, per work assignment in CHUNKS ("send:recv" chunk sizes for
#            MOELINK_HT_SEND_CHUNK / MOELINK_HT_RECV_CHUNK; "0:0" = one contiguous part per warp; "-" = default)
#   suite    moelink bench --suite --hook (EP4: HT tokens/SM sweeps, skewed, LL curves) with the P2P ceiling
#   ep2      moelink bench --ranks 2 (HT at 24 SMs, LL)
#   ll       moelink bench --mode ll --hook with MOELINK_LL_TRACE=1, EP4 and EP2, tokens 1-256: event times,
#            kernel spans and trace points, and the back-to-back (DeepEP's method) kernel times
#   llsoak   scripts/device/reliability.sh STEPS=soak over the LL families (host heap figures)
#   python   python -m moelink.bench under torchrun (moelink vs NCCL all_to_all_single)
# Everything lands in $OUT/results.tgz (logs, JSON) plus $OUT/summary.txt, printed last.
# Knobs: STEPS (default: all of the above in that order), SOAK_S (20), TUNE_VECS ("16 24"), CHUNKS ("- 0:0").
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/steps.sh
STEPS=${STEPS:-"tests soak tune roles suite ep2 llsoak python"}
SOAK_S=${SOAK_S:-20}
TUNE_VECS=${TUNE_VECS:-"16 24"}
CHUNKS=${CHUNKS:-"- 0:0"}
for s in $STEPS; do
    case $s in
    tests)
        for t in ht ll_cuda; do
            run "test-$t" 150 env -C crates/moelink MOELINK_TEST_RANKS=4 ../../.device/tests/moelink.test.$t --include-ignored
        done ;;
    soak)
        for tm in 32 1024; do
            run "soak-ht-t$tm" $((SOAK_S + 60)) "$STRESS" soak --backend cuda --families ht,ht-cached --t-max $tm --rounds 100000 \
                --time-budget-s "$SOAK_S" --json "$W/soak-ht-t$tm.json"
        done ;;
    tune)
        for v in $TUNE_VECS; do
            run "tune-vecs$v" 90 env MOELINK_HT_REDUCE_LOAD_VECS=$v "$BIN" bench --mode ht --dtype bf16 --num-sms 24 --reps 10 \
                --warmup 2 --json "$W/tune-vecs$v.json"
            note "  $(grep -E '^ht +combine' "$W/tune-vecs$v.log" | head -n1)"
        done ;;
    chunks)
        for c in $CHUNKS; do
            env_args=()
            [ "$c" != "-" ] && env_args=(MOELINK_HT_SEND_CHUNK="${c%%:*}" MOELINK_HT_RECV_CHUNK="${c##*:}")
            tag=${c//:/-}
            run "chunks-$tag" 120 env "${env_args[@]}" "$BIN" bench --mode ht --num-sms 24 --reps 20 --warmup 3 --no-host-check \
                --json "$W/chunks-$tag.json"
            note "  chunks $c: $(grep -E '^ht +uniform' "$W/chunks-$tag.log" | head -n1)"
        done ;;
    roles)
        run roles 200 env OUT="$W/roles" SPLITS="8:12" EXPERIMENTS="0 1 2" bash scripts/device/ht-roles.sh
        sed -n '/^dsend csend exp/,/^== summary/p' "$W/roles.log" | head -n 5 >> "$summary" ;;
    suite)
        run suite 300 "$BIN" bench --suite --hook --reps 20 --warmup 3 --p2p-ceiling-gbps 356 --json "$W/bench.json"
        sed -n '/^summary:/,$p' "$W/suite.log" >> "$summary" ;;
    ep2)
        run ep2 120 "$BIN" bench --ranks 2 --num-sms 24 --hook --reps 20 --warmup 3 --p2p-ceiling-gbps 356 --json "$W/bench-ep2.json"
        sed -n '/^summary:/,$p' "$W/ep2.log" >> "$summary" ;;
    ll)
        for r in 4 2; do
            run "ll-ep$r" 200 env MOELINK_LL_TRACE=1 "$BIN" bench --mode ll --ranks "$r" --ll-tokens 1,16,64,128,256 --hook \
                --reps 20 --warmup 3 --p2p-ceiling-gbps 356 --json "$W/bench-ll-ep$r.json"
            sed -n '/^summary:/,$p' "$W/ll-ep$r.log" >> "$summary"
        done
        python3 scripts/device/ll-trace-points.py "$W"/bench-ll-ep*.json >> "$summary" ;;
    llsoak)
        run llsoak 200 env OUT="$W/llsoak" STEPS=soak BUDGET_S=100 SOAK_S=60 \
            SOAK_ARGS="--families ll,ll-prereduced,ll-hook --seed 2" bash scripts/device/reliability.sh
        grep -iE "host (rss|heap)|mismatch|PASS|FAIL" "$W/llsoak.log" | tail -n 6 >> "$summary" ;;
    python)
        run python 200 env OUT="$W/py" PY_STEPS="bench" bash scripts/device/python.sh
        sed -n '/^== bench table/,/^== summary/p' "$W/python.log" >> "$summary" ;;
    esac
done
tar czf "$OUT/results.tgz" --exclude="$(basename "$W")/bin" -C "$(dirname "$W")" "$(basename "$W")"
echo "== summary"
cat "$summary"
