#!/usr/bin/env bash
# Runs THERE (kind nvidia-h200-x4, carry [".device"]): where the low-latency kernels' time goes.
#   tests  the LL GPU tests (bitwise against the host backend) first
#   trace  moelink bench --mode ll --hook with MOELINK_LL_TRACE=1 over LL_TOKENS (EP4, and EP2): event times
#          per graph replay next to the kernels' spans and the trace points (JSON: kernel_trace etc.)
#   plain  the same without the trace (what the stamps cost)
#   base   the trace with an earlier build, .device/base/moelink (copied there after build.sh), for an A/B
#          on the same machine in the same run
#   local  the trace with each MOELINK_LL_EXPERIMENT of EXPERIMENTS (local_stores: rows stored into the
#          sender's own region, the time NVLink adds to the send phases; no_loads: the send phases send zeros
#          without loading x / y, the time the loads take; local_stores,no_loads: both) — wrong results,
#          flagged incorrect — per RANKS
#   (points print as median/last over blocks, /b0 = block 0: the dispatch send's check block)
# Everything lands in $OUT/results.tgz plus $OUT/summary.txt, printed last.
# Knobs: STEPS ("tests trace plain local"), LL_TOKENS ("1,128"), RANKS ("4 2"), REPS (20), TEST_RANKS (4),
# EXPERIMENTS ("local_stores").
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/steps.sh
STEPS=${STEPS:-"tests trace plain local"}
LL_TOKENS=${LL_TOKENS:-"1,128"}
RANKS=${RANKS:-"4 2"}
REPS=${REPS:-20}
EXPERIMENTS=${EXPERIMENTS:-local_stores}
for s in $STEPS; do
    case $s in
    tests)
        run test-ll_cuda 150 env -C crates/moelink MOELINK_TEST_RANKS=${TEST_RANKS:-4} ../../.device/tests/moelink.test.ll_cuda \
            --include-ignored ;;
    trace|plain|base)
        for r in $RANKS; do
            if [ "$s" = plain ]; then e=(MOELINK_LL_TRACE=0); else e=(MOELINK_LL_TRACE=1); fi
            bin=$BIN
            if [ "$s" = base ]; then bin=$W/bin/moelink-base && cp .device/base/moelink "$bin" && chmod +x "$bin"; fi
            run "$s-ep$r" 200 env "${e[@]}" "$bin" bench --mode ll --ranks "$r" --ll-tokens "$LL_TOKENS" --hook --reps "$REPS" \
                --warmup 3 --json "$W/$s-ep$r.json"
            sed -n '/^mode/,$p' "$W/$s-ep$r.log" >> "$summary"
        done ;;
    local)
        for r in $RANKS; do
            for x in $EXPERIMENTS; do
                name="local-${x//,/+}-ep$r"
                run "$name" 200 env MOELINK_LL_TRACE=1 MOELINK_LL_EXPERIMENT="$x" "$BIN" bench --mode ll --ranks "$r" \
                    --ll-tokens "$LL_TOKENS" --hook --reps "$REPS" --warmup 3 --no-host-check --json "$W/$name.json"
                sed -n '/^mode/,$p' "$W/$name.log" >> "$summary"
            done
        done ;;
    esac
done
# The trace points of every LL record, one line each.
python3 scripts/device/ll-trace-points.py "$W"/base-*.json "$W"/trace-*.json "$W"/local-*.json 2>/dev/null >> "$summary"
tar czf "$OUT/results.tgz" -C "$W" .
cat "$summary"
