#!/usr/bin/env bash
# Runs THERE, on the GPU machine (device tool: kind nvidia-h200-x4, carry [".device"], command
# `bash scripts/device/run.sh`). Needs what scripts/device/build.sh put in .device/; no cargo, no network.
# The one entry for device work: the longer steps' bodies live in scripts/device/steps/ and run only from here.
#
# Steps (each under `timeout`, its exit status and seconds recorded, output appended to $OUT/log.txt):
#   info      moelink info
#   tests     every carried test executable, or those named in TEST_BINS, each under T_TEST_EACH seconds
#             (thread mode, GPU tests included, MOELINK_TEST_RANKS_INTRANODE ranks, default 8, sharing the GPUs)
#   selftest  moelink selftest --strict                          (thread mode, one rank per GPU)
#   process   torchrun --nproc_per_node=N --no-python moelink selftest --process --strict
#   nvlink    moelink bench nvlink --json $OUT/nvlink.json
#   bench     moelink bench $BENCH_ARGS --json $OUT/bench.json
#   sweep     steps/sweep.sh: the same bench call (SWEEP_ARGS) once per environment setting of SWEEP (tuning and
#             timing-experiment knobs), a table of the times (its files in results.tgz)
#   ab        steps/ab.sh: the same bench calls (AB_ARGS) with .device/base/moelink (build.sh with BASE_REV) and
#             this build's, alternating AB_ROUNDS times; a table of medians and head/base (its files in
#             results.tgz)
#   procbench steps/procbench.sh: moelink bench --process under torchrun, PROCBENCH_RANKS processes (default 2:
#             one per GPU of the first two), PROCBENCH_ARGS (default: HT and LL at DeepEP's shapes across 2x1
#             virtual nodes over nvshmem, then over emu-nic): the internode kernels between real GPUs, NVLink
#             standing in for RDMA
#   internode steps/internode.sh with STEPS=$INTERNODE_STEPS (default ht; its files in results.tgz)
#   python    steps/python.sh with PY_STEPS (its files in results.tgz)
#   reliability  steps/reliability.sh with RELIABILITY_STEPS (default chaos; its files in results.tgz)
# The sub-steps and their knobs are listed at the top of each file under steps/; the knobs pass through the
# environment (e.g. STEPS=reliability RELIABILITY_STEPS=soak SOAK_ARGS="--t-max 1024").
#
# Every step works whatever the ratio of ranks to GPUs: ranks of one process that share a GPU get
# CUDA_DEVICE_MAX_CONNECTIONS=32 hardware queues (moelink refuses fewer), and the test executables run with 8
# ranks (MOELINK_TEST_RANKS_INTRANODE, MOELINK_TEST_RANKS_INTERNODE) on however many GPUs there are, so that
# no test skips for want of ranks on a machine with fewer GPUs.
#
# Two instances may run side by side on disjoint GPUs (CUDA_VISIBLE_DEVICES) with their own OUT and W.
#
# Knobs (environment): STEPS="info tests selftest process nvlink bench" picks and orders steps; BENCH_ARGS,
# NVLINK_ARGS (default --no-jit), TEST_ARGS (default --include-ignored --test-threads=1) pass options; T_<STEP>
# sets a step's timeout in seconds; BUDGET_S (default 570) is the whole run's budget: a step that no longer fits
# is skipped, and the steps under steps/ get what is left of their timeout as their own BUDGET_S. An unknown step
# name stops the run before anything runs. DRY_RUN=1 needs no GPU and no .device/: it prints each step's
# command, and the steps under steps/ check their sub-step names, instead of running anything.
#
# Comes back in $OUT (the device tool returns at most 8 files): env.txt, log.txt, summary.md, nvlink.json,
# bench.json, procbench-<transport>.json, results.tgz (the files of the steps under steps/). The summary table
# is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
START=$(date +%s)
STEP_DIR=scripts/device/steps
DRY_RUN=${DRY_RUN:-}
STEPS=${STEPS:-"info tests selftest process nvlink bench"}
KNOWN_STEPS="info tests selftest process nvlink bench ab procbench internode python reliability sweep"
for s in $STEPS; do
    case " $KNOWN_STEPS " in
        *" $s "*) ;;
        *) echo "error: unknown step '$s' (known: $KNOWN_STEPS)" >&2; exit 2 ;;
    esac
done

OUT=${OUT:-/tmp/moelink-out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
SUMMARY=$OUT/summary.md
: >"$LOG"

DEV=$ROOT/.device
if [ ! -f "$DEV/moelink" ] && [ -z "$DRY_RUN" ]; then
    echo "error: $DEV/moelink is missing: run scripts/device/build.sh on the build machine and carry .device" | tee -a "$LOG"
    exit 1
fi
# Run from a private copy: the carried tree may not keep exec bits. W: this instance's work folder.
W=${W:-/tmp/moelink-run}
rm -rf "$W" && mkdir -p "$W"
# SCRATCH: this instance's folder for what the steps install or start (Python sites, MPS pipes, chaos logs),
# beside W so that results.tgz leaves it out.
SCRATCH=$W.scratch
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"
BIN_DIR=$W/bin
mkdir -p "$BIN_DIR/tests"
[ -f "$DEV/moelink" ] && cp "$DEV/moelink" "$BIN_DIR/moelink" && chmod +x "$BIN_DIR/moelink"
if [ -f "$DEV/base/moelink" ]; then
    mkdir -p "$BIN_DIR/base" && cp "$DEV/base/moelink" "$BIN_DIR/base/moelink" && chmod +x "$BIN_DIR/base/moelink"
fi
if [ -d "$DEV/tests" ]; then
    cp "$DEV"/tests/* "$BIN_DIR/tests/" 2>/dev/null
    chmod +x "$BIN_DIR"/tests/* 2>/dev/null
fi
BIN=$BIN_DIR/moelink

# Settings every GPU process here needs (DEVICE.md): no NVLink multicast; NVRTC from the CUDA install.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Ranks of one process that share a GPU need hardware queues apart (moelink refuses fewer than 8 per rank).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export MOELINK_CACHE_DIR=${MOELINK_CACHE_DIR:-/tmp/moelink-jit}
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NGPU=${NGPU:-$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)}
fi
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "$NGPU" -ge 1 ] 2>/dev/null || NGPU=1
export MOELINK_TEST_RANKS=$NGPU
MOELINK_COMMIT=$(sed -n 's/^commit: //p' "$DEV/manifest.txt" 2>/dev/null)
export MOELINK_COMMIT=${MOELINK_COMMIT:-unknown}
export PYTHONUNBUFFERED=1

BUDGET_S=${BUDGET_S:-570}
TEST_ARGS=${TEST_ARGS:---include-ignored --test-threads=1}
BENCH_ARGS=${BENCH_ARGS:-}
# The JIT-timing probe compiles kernels cold (over 90 s on a fresh machine): left out unless NVLINK_ARGS says
# otherwise.
NVLINK_ARGS=${NVLINK_ARGS:---no-jit}

{
    echo "== date";      date -u +%Y-%m-%dT%H:%M:%SZ
    echo "== host";      hostname; uname -srm; grep PRETTY /etc/os-release; ldd --version 2>&1 | head -n1
    echo "== manifest";  cat "$DEV/manifest.txt"
    echo "== settings";  echo "STEPS=$STEPS NGPU=$NGPU BUDGET_S=$BUDGET_S BENCH_ARGS=$BENCH_ARGS NVLINK_ARGS=$NVLINK_ARGS TEST_ARGS=$TEST_ARGS"
    env | grep -E '^(NCCL_NVLS_ENABLE|NVSHMEM_DISABLE_NVLS|TORCH_SYMM_MEM_DISABLE_MULTICAST|LD_LIBRARY_PATH|MOELINK_)' | sort
    echo "== nvidia-smi"
    nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,persistence_mode --format=csv
    echo "== topology";  nvidia-smi topo -m
    echo "== nvlink (GPU 0)"; nvidia-smi nvlink -s -i 0 2>&1 | head -n 24
    echo "== cuda";      ls -l /usr/local/cuda/lib64/libnvrtc.so* 2>&1; nvcc --version 2>&1 | tail -n 2
    echo "== python";    command -v python3 torchrun; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    echo "== moelink binary (built on Debian 12, glibc 2.36)"; ldd "$BIN"
} >"$OUT/env.txt" 2>&1

declare -a ROWS=()
elapsed() { echo $(( $(date +%s) - START )); }

# step NAME TIMEOUT_S COMMAND... : runs one step, logs it, records "name|rc|seconds".
step() {
    local name=$1 t=$2; shift 2
    local left=$(( BUDGET_S - $(elapsed) ))
    if [ "$left" -lt 10 ]; then
        echo "===== $name: skipped (time budget of ${BUDGET_S}s used up)" | tee -a "$LOG"
        ROWS+=("$name|skipped|0")
        return
    fi
    [ "$t" -gt "$left" ] && t=$left
    if [ -n "$DRY_RUN" ]; then
        echo "===== $name (timeout ${t}s, dry run): $*" | tee -a "$LOG"
        # A body under steps/ checks its sub-steps and exits: run it, so that a dry run covers their names too.
        local rc=dry a
        for a in "$@"; do
            case $a in "$STEP_DIR"/*)
                if [ -f "$a" ]; then "$@" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}; else echo "missing: $a" | tee -a "$LOG"; rc=127; fi ;;
            esac
        done
        ROWS+=("$name|$rc|0")
        return
    fi
    echo "===== $name (timeout ${t}s): $*" | tee -a "$LOG"
    local t0
    t0=$(date +%s)
    timeout --kill-after=10 "$t" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local secs=$(( $(date +%s) - t0 ))
    [ "$rc" = 124 ] && echo "===== $name: timed out after ${t}s" | tee -a "$LOG"
    echo "===== $name: rc=$rc ${secs}s" | tee -a "$LOG"
    ROWS+=("$name|$rc|$secs")
}

run_tests() {
    local worst=0 b crate rc
    shopt -s nullglob
    local bins=()
    if [ -n "${TEST_BINS:-}" ]; then
        for b in $TEST_BINS; do bins+=("$BIN_DIR/tests/$b"); done
    else
        bins=("$BIN_DIR"/tests/*)
    fi
    if [ ${#bins[@]} -eq 0 ]; then
        echo "no test executables carried"
        return 1
    fi
    for b in "${bins[@]}"; do
        # cargo runs a crate's tests from its directory; do the same so relative paths resolve.
        crate=${b##*/}; crate=${crate%%.*}
        echo "--- $(basename "$b")"
        # The internode tests use fixed rank counts up to 8, sharing the GPUs there are.
        local ranks=${MOELINK_TEST_RANKS_INTRANODE:-8}
        case $b in *internode*) ranks=${MOELINK_TEST_RANKS_INTERNODE:-8} ;; esac
        # Each executable under its own timeout: one hang must not hide the others' results.
        (cd "$ROOT/crates/$crate" 2>/dev/null || cd "$ROOT" || exit; MOELINK_TEST_RANKS=$ranks timeout --kill-after=10 "${T_TEST_EACH:-240}" "$b" $TEST_ARGS)
        rc=$?
        [ "$rc" = 124 ] && echo "--- $(basename "$b"): timed out after ${T_TEST_EACH:-240}s"
        [ "$rc" -gt "$worst" ] && worst=$rc
    done
    return "$worst"
}
export -f run_tests
export BIN BIN_DIR ROOT OUT SCRATCH NGPU TEST_ARGS TEST_BINS T_TEST_EACH MOELINK_TEST_RANKS MOELINK_TEST_RANKS_INTRANODE MOELINK_TEST_RANKS_INTERNODE DRY_RUN
# The bodies under steps/ run only from here.
export MOELINK_DEVICE_RUN=1

# sub_budget T: the budget of a step under steps/ that has T seconds: what its timeout leaves, less 20 s for
# its own summary.
sub_budget() {
    local t=$1 left=$(( BUDGET_S - $(elapsed) ))
    [ "$t" -gt "$left" ] && t=$left
    echo $(( t - 20 ))
}

for s in $STEPS; do
    case $s in
        info)     step info     "${T_INFO:-30}"     "$BIN" info ;;
        tests)    step tests    "${T_TESTS:-300}"   bash -c run_tests ;;
        selftest) step selftest "${T_SELFTEST:-45}" "$BIN" selftest --strict ;;
        process)  step process  "${T_PROCESS:-60}"  torchrun --nproc_per_node="$NGPU" --no-python "$BIN" selftest --process --strict ;;
        nvlink)   step nvlink   "${T_NVLINK:-90}"   "$BIN" bench nvlink $NVLINK_ARGS --json "$OUT/nvlink.json" ;;
        bench)    step bench    "${T_BENCH:-180}"   "$BIN" bench $BENCH_ARGS --json "$OUT/bench.json" ;;
        ab)       step ab       "${T_AB:-300}"      env OUT="$W/ab" bash "$STEP_DIR/ab.sh" ;;
        sweep)    step sweep    "${T_SWEEP:-400}"   env OUT="$W/sweep" bash "$STEP_DIR/sweep.sh" ;;
        procbench) step procbench "${T_PROCBENCH:-240}" bash "$STEP_DIR/procbench.sh" ;;
        internode)
            step internode "${T_INTERNODE:-540}" env OUT="$W/internode" W="$W/internode-work" STEPS="${INTERNODE_STEPS:-ht}" \
                BUDGET_S="$(sub_budget "${T_INTERNODE:-540}")" bash "$STEP_DIR/internode.sh" ;;
        python)
            step python "${T_PYTHON:-400}" env OUT="$W/python" bash "$STEP_DIR/python.sh" ;;
        reliability)
            step reliability "${T_RELIABILITY:-360}" env OUT="$W/reliability" STEPS="${RELIABILITY_STEPS:-chaos}" \
                BUDGET_S="$(sub_budget "${T_RELIABILITY:-360}")" bash "$STEP_DIR/reliability.sh" ;;
    esac
done

# Key numbers per step, from the log and the JSON files.
key_numbers() {
    case $1 in
        info)     grep -E '^(GPUs:|backend auto)' "$LOG" | tr '\n' ' ' ;;
        tests)    awk '/^===== tests /{on=1} on && /^test result:/{p+=$4; f+=$6; i+=$8} /^===== tests: rc/{on=0}
                       END{printf "%d passed, %d failed, %d ignored", p, f, i}' FS='[ ;]+' "$LOG" ;;
        # torchrun may prefix worker lines ("[rank0]:"), so match anywhere in the line.
        selftest|process)
                  awk -v s="$1" '$0 ~ "^===== " s " " {on=1} on && /selftest: [0-9]+ passed/ {l=$0}
                       $0 ~ "^===== " s ": rc" {on=0} END{print l}' "$LOG" ;;
        ab)       awk '/^===== ab /{on=1} on && /^\| [a-z]/ && $(NF-1) ~ /^[0-9.]+$/ {n++; r=$(NF-1); s+=r; if (r>m) m=r}
                       /^===== ab: rc/{on=0} END{if (n) printf "%d cases, head/base mean %.3f, max %.3f", n, s/n, m}' "$LOG" ;;
        nvlink|bench)
            python3 - "$OUT/$1.json" <<'PY' 2>/dev/null
import json, sys
try:
    recs = json.load(open(sys.argv[1]))
except Exception:
    print("no JSON written"); sys.exit()
parts = []
for r in recs:
    if r.get("status") != "ok":
        parts.append(f"{r['mode']} {r['op']}: {r.get('status')}")
        continue
    if r["op"] == "copy":
        parts.append(f"{r.get('pattern')}/{r.get('method')}@{r.get('num_sms')}: {r['logical_gbps']:.0f} GB/s")
    elif r["op"] in ("barrier", "jit"):
        parts.append(f"{r['op']} {r.get('kernel', '')}: {r['time_us']:.1f} us".replace("  ", " "))
    else:
        parts.append(f"{r['mode']} {r['op']} {r['dtype']} {r['routing']}: {r['time_us']:.1f} us")
print("; ".join(parts[:12]) + (f"; ... ({len(parts)} records)" if len(parts) > 12 else ""))
PY
            ;;
    esac
}

# The files of the steps under steps/ (logs, JSON) in one archive: the device tool returns at most 8 files,
# each up to 16 MiB, so the binaries stay out.
tar czf "$OUT/results.tgz" -C "$W" --exclude=./bin --exclude=./internode-work/bin . 2>/dev/null

{
    echo "| step | rc | seconds | key numbers |"
    echo "|---|---|---|---|"
    for row in "${ROWS[@]}"; do
        IFS='|' read -r name rc secs <<<"$row"
        if [ "$rc" = dry ]; then keys=""; else keys=$(key_numbers "$name" | tr '|' '/'); fi
        echo "| $name | $rc | $secs | $keys |"
    done
    echo
    echo "commit $MOELINK_COMMIT, $NGPU GPUs, total $(elapsed)s, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$SUMMARY"
echo
echo "================ SUMMARY ================"
cat "$SUMMARY"
# A dry run fails when a step body refused its sub-steps (or is missing).
if [ -n "$DRY_RUN" ]; then
    for row in "${ROWS[@]}"; do
        IFS='|' read -r name rc secs <<<"$row"
        case $rc in dry | 0) ;; *) exit 1 ;; esac
    done
fi
