#!/usr/bin/env bash
# Runs THERE, on any GPU machine (one GPU is enough; carry [".device"]): the GPU tests and soaks with
# several ranks sharing each GPU (thread mode: rank r on GPU r % count). Correctness only: ranks on one GPU
# exchange through its own memory, not NVLink, so nothing here is a performance figure.
#   base     the binaries in .device/base/ (an earlier build, if carried): one HT and one LL test at 2 ranks
#            on GPU 0, with and without CUDA_MODULE_LOADING=EAGER (what the earlier build did there)
#   tests    every GPU test executable at each rank count in RANKS (default "2 4"), ignored (GPU) tests
#            included (the candle example's too: its layer on the CUDA backend against the dense one); a test
#            that needs more ranks than it is given says it skips
#   ep8      the 8-rank HT and LL tests (8 ranks on the machine's GPUs)
#   soak     moelink-stress soak with SOAK_RANKS ranks (default 4), SOAK_S seconds each: the HT families at each largest
#            token count of SOAK_HT_T_MAX (default "32"), then the LL families at LL T <= SOAK_LL_T_MAX (16)
#   ab       moelink bench of this build and of .device/base/moelink (an earlier build, if carried, with its
#            commit in .device/base/COMMIT) in turn base, new, base, new, at each rank count of AB_RANKS
#            (default "1"; the bench refuses more ranks than GPUs): HT at 24 SMs and LL at DeepEP's shapes.
#            A no-regression check of kernel changes on this GPU (the spread between the two runs of one
#            build is the noise); not the NVLink figures.
# Everything lands in $OUT/results.tgz plus $OUT/summary.txt, printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/steps.sh
STEPS=${STEPS:-"base tests ep8 soak ab"}
RANKS=${RANKS:-"2 4"}
SOAK_RANKS=${SOAK_RANKS:-4}
SOAK_S=${SOAK_S:-30}
export MOELINK_TEST_TIMEOUT_MS=${MOELINK_TEST_TIMEOUT_MS:-5000}
note "ranks share GPUs: $(nvidia-smi -L | wc -l) GPU(s)"
test_bin() {  # test_bin NAME RANKS EXECUTABLE [FILTER...]: one test executable, from its crate's folder
    local name=$1 ranks=$2 exe=$3
    shift 3
    local crate=${exe%%.*} dir
    dir=crates/$crate; [ -d "$dir" ] || dir=examples/$crate  # the candle example is its own workspace
    cp ".device/tests/$exe" "$W/bin/$exe" && chmod +x "$W/bin/$exe"
    run "$name" 300 env -C "$dir" MOELINK_TEST_RANKS="$ranks" "$W/bin/$exe" --include-ignored --test-threads=1 "$@"
}
for s in $STEPS; do
    case $s in
    base)
        [ -d .device/base ] || { note "base: no .device/base carried"; continue; }
        for mode in lazy eager; do
            loading=(); [ $mode = eager ] && loading=(CUDA_MODULE_LOADING=EAGER)
            for t in "ht cuda::dispatch_uniform_bf16_ep2" "ll cuda::ep2_bf16_and_fp8_hidden_2048"; do
                set -- $t
                # Builds before the rename call the LL test executable ll_host.
                cp ".device/base/moelink.test.$1" "$W/bin/base.$1" 2>/dev/null || cp ".device/base/moelink.test.$1_host" "$W/bin/base.$1"
                chmod +x "$W/bin/base.$1"
                # An earlier build reads MOELINK_TEST_CUDA/MOELINK_TEST_GPUS (before they became
                # --include-ignored/MOELINK_TEST_RANKS): both are given, for builds from either side.
                run "base-$mode-$1" 60 env -C crates/moelink "${loading[@]}" MOELINK_LL_SMS=64 MOELINK_TEST_RANKS=2 \
                    MOELINK_TEST_CUDA=1 MOELINK_TEST_GPUS=2 MOELINK_TEST_TIMEOUT_MS=3000 "$W/bin/base.$1" --include-ignored \
                    --test-threads=1 --exact "$2"
            done
        done ;;
    tests)
        test_bin "cuda-gpu" 1 moelink-cuda.test.gpu
        for r in $RANKS; do
            for t in ht ll ll_cuda poison diag_gpu capacity; do
                test_bin "r$r-$t" "$r" "moelink.test.$t"
            done
            [ -f .device/tests/candle-moe.test.ep_matches_dense ] && test_bin "r$r-candle" "$r" candle-moe.test.ep_matches_dense
        done ;;
    ep8)
        test_bin "r8-ht" 8 moelink.test.ht --exact cuda::dispatch_eight_ranks
        test_bin "r8-ll" 8 moelink.test.ll --exact cuda::ep8_and_ep1 ;;
    ab)
        [ -x .device/base/moelink ] || { note "ab: no .device/base/moelink carried"; continue; }
        cp .device/base/moelink $W/bin/base && chmod +x $W/bin/base
        for r in ${AB_RANKS:-1}; do
            for i in 1 2; do
                for b in base new; do
                    # Each build's records carry its own commit (.device/base/COMMIT, written when it is staged).
                    exe=$BIN commit=$MOELINK_COMMIT
                    [ $b = base ] && exe=$W/bin/base commit=$(cat .device/base/COMMIT 2>/dev/null || echo base-unknown)
                    run "ab-r$r-$b$i" 120 env MOELINK_COMMIT="$commit" "$exe" bench --ranks "$r" --num-sms 24 --reps 20 \
                        --json "$W/ab-r$r-$b$i.json"
                    note "$(grep -E '^(ht|ll) +(uniform|skewed) ' "$W/ab-r$r-$b$i.log" | sed 's/  */ /g' | head -n 2 | tr '\n' '|')"
                done
            done
        done ;;
    soak)
        for tm in ${SOAK_HT_T_MAX:-32}; do
            run "soak-ht-t$tm" $((SOAK_S + 120)) "$STRESS" soak --backend cuda --ranks "$SOAK_RANKS" --families ht,ht-cached --t-max "$tm" \
                --rounds 100000 --time-budget-s "$SOAK_S" --json "$W/soak-ht-t$tm.json"
        done
        run soak-ll $((SOAK_S + 120)) "$STRESS" soak --backend cuda --ranks "$SOAK_RANKS" --families ll,ll-prereduced,ll-hook --rounds 100000 \
            --ll-t-max "${SOAK_LL_T_MAX:-16}" --time-budget-s "$SOAK_S" --json "$W/soak-ll.json" ;;
    esac
    tar czf "$OUT/results.tgz" --exclude="$(basename "$W")/bin" -C "$(dirname "$W")" "$(basename "$W")"  # after every step: a call cut short still returns the logs
done
echo "== summary"
cat "$summary"
