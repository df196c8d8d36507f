#!/usr/bin/env bash
# Runs THERE (kind nvidia-h200-x4, carry [".device"]): where the low-latency kernels' time goes.
#   tests  the LL GPU tests (bitwise against the host backend) first
#   trace  moelink bench --mode ll --hook with MOELINK_LL_TRACE=1 over LL_TOKENS (EP4, and EP2): event times
#          per graph replay next to the kernels' spans and the trace points (JSON: kernel_trace etc.)
#   plain  the same without the trace (what the stamps cost)
#   (points print as median/last over blocks, /b0 = block 0, the send phases' index block)
#   local  the trace with MOELINK_LL_EXPERIMENT=local_stores (rows stored into the sender's own region:
#          wrong results, flagged incorrect; the time NVLink adds to the send phases), EP4
# Everything lands in $OUT/results.tgz plus $OUT/summary.txt, printed last.
# Knobs: STEPS ("tests trace plain"), LL_TOKENS ("1,128"), RANKS ("4 2"), REPS (20).
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/steps.sh
STEPS=${STEPS:-"tests trace plain local"}
LL_TOKENS=${LL_TOKENS:-"1,128"}
RANKS=${RANKS:-"4 2"}
REPS=${REPS:-20}
for s in $STEPS; do
    case $s in
    tests)
        run test-ll_cuda 150 env -C crates/moelink MOELINK_TEST_CUDA=1 MOELINK_TEST_GPUS=4 ../../.device/tests/moelink.test.ll_cuda ;;
    trace|plain)
        for r in $RANKS; do
            if [ "$s" = trace ]; then e=(MOELINK_LL_TRACE=1); else e=(MOELINK_LL_TRACE=0); fi
            run "$s-ep$r" 200 env "${e[@]}" "$BIN" bench --mode ll --ranks "$r" --ll-tokens "$LL_TOKENS" --hook --reps "$REPS" \
                --warmup 3 --json "$W/$s-ep$r.json"
            sed -n '/^mode/,$p' "$W/$s-ep$r.log" >> "$summary"
        done ;;
    local)
        run local-ep4 200 env MOELINK_LL_TRACE=1 MOELINK_LL_EXPERIMENT=local_stores "$BIN" bench --mode ll --ranks 4 \
            --ll-tokens "$LL_TOKENS" --hook --reps "$REPS" --warmup 3 --no-host-check --json "$W/local-ep4.json"
        sed -n '/^mode/,$p' "$W/local-ep4.log" >> "$summary" ;;
    esac
done
# The trace points of every LL record, one line each.
python3 scripts/device/ll-trace-points.py "$W"/trace-*.json "$W"/local-*.json 2>/dev/null >> "$summary"
tar czf "$OUT/results.tgz" -C "$W" .
cat "$summary"
