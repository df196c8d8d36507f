#!/usr/bin/env bash
# Step `reliability` of scripts/device/run.sh (RELIABILITY_STEPS picks the sub-steps below; kind
# nvidia-h200-x4, carry [".device"]); also run by steps/internode.sh's htchaos.
#
# Steps (each under `timeout`; the whole step under BUDGET_S, which run.sh sets; a step that no longer fits is
# skipped, and the soak gets what is left):
#   chaos   `moelink-stress chaos` in process mode, one process per GPU launched directly (torchrun would kill
#           every worker once one dies): rank VICTIM (default 3) SIGKILLs itself in the middle of an HT
#           dispatch, an HT combine, an LL dispatch and an LL combine (survivors must time out naming it,
#           stay alive, rebuild over the survivors and pass a checked round trip), then LL dispatch and
#           combine again with --shrink (survivors mask it and keep serving, checked against the host
#           backend). Every rank prints one CHAOS_* line; they are collected into reliability.json.
#   poison  the poison test executable (tests/poison.rs), GPU tests included, at MOELINK_TEST_RANKS_INTRANODE
#           ranks (8) sharing the GPUs: a kernel timeout poisons every entry point until rebuilt; dropping a
#           buffer with kernels in flight waits for them.
#   soak    `moelink-stress soak --backend cuda` (thread mode, one rank per GPU): up to SOAK_ROUNDS (10000) rounds
#           of each family checked bit for bit against the host backend, memory sampled, stopping at the
#           time left (at most SOAK_S seconds) with honest counts.
#
# Knobs: STEPS (run.sh's RELIABILITY_STEPS) among "chaos poison soak", RANKS (chaos processes, default one
# per GPU; more share the GPUs under MPS), BUDGET_S, SOAK_S (default 200), SOAK_ROUNDS, SOAK_ARGS, VICTIM,
# CHAOS_TIMEOUT_MS (the buffers' deadline, default 3000), CHAOS_RUNS (default
# "ht-dispatch ht-combine ll-dispatch ll-combine ll-dispatch:shrink ll-combine:shrink"), CHAOS_ARGS (extra
# options; `--backend host` checks this script's plumbing on a machine without GPU: NGPU=4),
# CHAOS_PORT_BASE (run i rendezvous at CHAOS_PORT_BASE + 20 i, default 29400), CHAOS_T_S (each chaos process's
# time limit, default 45).
# Across virtual nodes: RANKS=4 CHAOS_ARGS="--topology 2x2 --transport emu-nic|ptr|nvshmem", every phase (the
# HT ones check what hti_*.cu's timeouts can name: crates/moelink-stress/src/chaos.rs, module docs);
# the internode step's htchaos runs the HT ones on emu-nic and nvshmem.
#
# Writes into $OUT (run.sh's $W/reliability, packed into its results.tgz): env.txt, reliability.json,
# reliability-summary.md, reliability-log.txt (every chaos process's output), poison-log.txt, soak.json,
# soak-log.txt. The summary is printed last.
set -uo pipefail
[ -n "${MOELINK_DEVICE_RUN:-}" ] || { echo "$0 is a step of scripts/device/run.sh: STEPS=reliability bash scripts/device/run.sh" >&2; exit 2; }
cd "$ROOT" || exit 1
STEPS=${STEPS:-"chaos poison soak"}
for s in $STEPS; do
    case $s in
    chaos | poison | soak) ;;
    *) echo "reliability: unknown step '$s' (known: chaos poison soak)" >&2; exit 2 ;;
    esac
done
if [ -n "${DRY_RUN:-}" ]; then echo "reliability: would run $STEPS"; exit 0; fi
START=$(date +%s)

OUT=${OUT:-/tmp/moelink-out}
mkdir -p "$OUT"
DEV=$ROOT/.device
if [ ! -f "$DEV/moelink-stress" ]; then
    echo "error: $DEV/moelink-stress is missing: run scripts/device/build.sh on the build machine and carry .device"
    exit 1
fi
BIN_DIR=$SCRATCH/rel-bin
rm -rf "$BIN_DIR" && mkdir -p "$BIN_DIR/tests"
cp "$DEV/moelink-stress" "$BIN_DIR/moelink-stress" && chmod +x "$BIN_DIR/moelink-stress"
cp "$DEV"/tests/moelink.test.poison "$BIN_DIR/tests/" 2>/dev/null && chmod +x "$BIN_DIR"/tests/*
STRESS=$BIN_DIR/moelink-stress

export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# One JIT cache for every process of the run (chaos ranks, soak): each kernel variant compiles once.
export MOELINK_CACHE_DIR=${MOELINK_CACHE_DIR:-/tmp/moelink-jit}
MOELINK_COMMIT=$(sed -n 's/^commit: //p' "$DEV/manifest.txt" 2>/dev/null)
export MOELINK_COMMIT=${MOELINK_COMMIT:-unknown}
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "$NGPU" -ge 1 ] 2>/dev/null || NGPU=1
# Chaos processes: one per GPU, or RANKS of them sharing the GPUs (rank r on GPU r mod NGPU) under CUDA MPS,
# started here as an ordinary daemon (pipe and log under $SCRATCH, compute mode untouched) and quit after.
RANKS=${RANKS:-$NGPU}

BUDGET_S=${BUDGET_S:-360}
SOAK_S=${SOAK_S:-200}
SOAK_ROUNDS=${SOAK_ROUNDS:-10000}
SOAK_ARGS=${SOAK_ARGS:-}
VICTIM=${VICTIM:-3}
CHAOS_TIMEOUT_MS=${CHAOS_TIMEOUT_MS:-3000}
CHAOS_RUNS=${CHAOS_RUNS:-"ht-dispatch ht-combine ll-dispatch ll-combine ll-dispatch:shrink ll-combine:shrink"}
CHAOS_ARGS=${CHAOS_ARGS:-}
CHAOS_LOG=$OUT/reliability-log.txt
: >"$CHAOS_LOG"

{
    echo "== date"; date -u +%Y-%m-%dT%H:%M:%SZ
    echo "== host"; hostname; uname -srm
    echo "== manifest"; cat "$DEV/manifest.txt"
    echo "== settings"; echo "STEPS=$STEPS NGPU=$NGPU RANKS=$RANKS BUDGET_S=$BUDGET_S SOAK_S=$SOAK_S SOAK_ROUNDS=$SOAK_ROUNDS VICTIM=$VICTIM CHAOS_TIMEOUT_MS=$CHAOS_TIMEOUT_MS"
    echo "CHAOS_RUNS=$CHAOS_RUNS CHAOS_ARGS=$CHAOS_ARGS SOAK_ARGS=$SOAK_ARGS"
    echo "== nvidia-smi"; nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv
    echo "== ulimit -c"; ulimit -c
} >"$OUT/env.txt" 2>&1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
declare -a ROWS=()

# One chaos run: RANKS processes with torchrun's variables, each under its own timeout; the victim's exit
# status is 137 (SIGKILL), the survivors' 0 when their checks passed.
chaos_run() {
    local idx=$1 spec=$2 phase=${2%%:*} extra="" port=$((${CHAOS_PORT_BASE:-29400} + 20 * $1)) t=${CHAOS_T_S:-45} r
    [ "$spec" != "$phase" ] && extra="--shrink"
    local tag="chaos-$idx-$phase${extra:+-shrink}"
    local -a pids=()
    echo "===== $tag (victim $VICTIM, deadline ${CHAOS_TIMEOUT_MS} ms, port $port)" | tee -a "$CHAOS_LOG"
    local t0; t0=$(date +%s%N)
    for ((r = 0; r < RANKS; r++)); do
        RANK=$r WORLD_SIZE=$RANKS LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port MOELINK_GROUP_TIMEOUT_MS=60000 \
            timeout --kill-after=5 "$t" "$STRESS" chaos --phase "$phase" --victim "$VICTIM" --timeout-ms "$CHAOS_TIMEOUT_MS" \
            --seed $((idx + 1)) $extra $CHAOS_ARGS >"$SCRATCH/$tag-r$r.log" 2>&1 &
        pids[r]=$!
    done
    local rcs=""
    for ((r = 0; r < RANKS; r++)); do
        wait "${pids[r]}"
        rcs="$rcs $?"
    done
    local secs=$(( ($(date +%s%N) - t0) / 1000000 ))
    for ((r = 0; r < RANKS; r++)); do
        sed "s/^/[$tag r$r] /" "$SCRATCH/$tag-r$r.log" >>"$CHAOS_LOG"
    done
    echo "RUN $tag phase=$phase shrink=${extra:+1} victim=$VICTIM rcs=${rcs# } wall_ms=$secs" | tee -a "$CHAOS_LOG"
}

step_chaos() {
    local i=0 spec
    if [ "$RANKS" -lt 2 ] || [ "$VICTIM" -ge "$RANKS" ]; then
        echo "chaos needs at least 2 ranks and VICTIM < RANKS ($RANKS ranks on $NGPU GPUs)" | tee -a "$CHAOS_LOG"
        return 1
    fi
    local mps=0
    if [ "$RANKS" -gt "$NGPU" ] && [ "${CHAOS_ARGS#*--backend host}" = "$CHAOS_ARGS" ]; then
        export CUDA_MPS_PIPE_DIRECTORY=$SCRATCH/mps-pipe CUDA_MPS_LOG_DIRECTORY=$SCRATCH/mps-log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && mps=1 && echo "MPS daemon started ($RANKS ranks on $NGPU GPUs)" | tee -a "$CHAOS_LOG"
        # One rank per process: no extra hardware queues (four MPS clients asking for run.sh's 32 each fail to create
        # their contexts: CUDA_ERROR_OUT_OF_MEMORY; two work).
        local connections=${CUDA_DEVICE_MAX_CONNECTIONS-}
        unset CUDA_DEVICE_MAX_CONNECTIONS
    fi
    for spec in $CHAOS_RUNS; do
        if [ "$(left)" -lt 60 ]; then
            echo "RUN chaos-$i-$spec skipped: budget" | tee -a "$CHAOS_LOG"
        else
            chaos_run "$i" "$spec"
        fi
        i=$((i + 1))
    done
    if [ "$mps" = 1 ]; then
        echo quit | nvidia-cuda-mps-control; echo "MPS daemon quit" | tee -a "$CHAOS_LOG"
        [ -n "$connections" ] && export CUDA_DEVICE_MAX_CONNECTIONS=$connections
    fi
}

step_poison() {
    local b=$BIN_DIR/tests/moelink.test.poison t
    [ -x "$b" ] || { echo "no poison test executable carried (.device/tests/moelink.test.poison)"; return 1; }
    t=$(( $(left) - 10 )); [ "$t" -gt 120 ] && t=120
    (cd "$ROOT/crates/moelink" && MOELINK_TEST_RANKS=${MOELINK_TEST_RANKS_INTRANODE:-8} timeout --kill-after=10 "$t" "$b" --include-ignored --test-threads=1 2>&1) \
        | tee "$OUT/poison-log.txt"
    return "${PIPESTATUS[0]}"
}

step_soak() {
    local t=$(( $(left) - 25 ))
    [ "$t" -gt "$SOAK_S" ] && t=$SOAK_S
    if [ "$t" -lt 20 ]; then echo "soak skipped: ${t}s left"; return 1; fi
    # The soak stops itself at the budget; the outer timeout only guards against a hang.
    timeout --kill-after=10 $((t + 60)) "$STRESS" soak --backend cuda --rounds "$SOAK_ROUNDS" --time-budget-s "$t" \
        --json "$OUT/soak.json" --progress-s 20 $SOAK_ARGS 2>&1 | tee "$OUT/soak-log.txt"
    return "${PIPESTATUS[0]}"
}

for s in $STEPS; do
    if [ "$(left)" -lt 15 ]; then
        echo "===== $s: skipped (budget)"; ROWS+=("$s|skipped|0"); continue
    fi
    echo "===== $s ($(left)s left)"
    t0=$(date +%s)
    case $s in
        chaos) step_chaos; rc=$? ;;
        poison) step_poison; rc=$? ;;
        soak) step_soak; rc=$? ;;
        *) echo "unknown step $s"; rc=2 ;;
    esac
    ROWS+=("$s|$rc|$(( $(date +%s) - t0 ))")
done

# Collect the chaos lines into reliability.json and write the summary.
python3 - "$CHAOS_LOG" "$OUT" "${ROWS[@]}" <<'PY'
import json, re, sys, os
log, out, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
runs, cur = [], {}
for line in open(log, errors="replace"):
    m = re.match(r"\[(chaos-[^ ]+) r(\d+)\] (CHAOS_RESULT|CHAOS_KILL) (\{.*\})\s*$", line)
    if m:
        tag, rank, kind, body = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        try:
            d = json.loads(body)
        except ValueError:
            d = {"unparsed": body}
        cur.setdefault(tag, {"ranks": {}, "kill": None})
        if kind == "CHAOS_KILL":
            cur[tag]["kill"] = d
        else:
            cur[tag]["ranks"][rank] = d
        continue
    m = re.match(r"RUN (chaos-\S+) phase=(\S+) shrink=(\S*) victim=(\d+) rcs=([\d ]+) wall_ms=(\d+)", line)
    if m:
        tag = m.group(1)
        r = cur.pop(tag, {"ranks": {}, "kill": None})
        rcs = [int(x) for x in m.group(5).split()]
        victim = int(m.group(4))
        kill = r["kill"] or {}
        survivors = []
        for rank, rc in enumerate(rcs):
            if rank == victim:
                continue
            d = r["ranks"].get(rank, {"verdict": "fail", "reasons": ["no CHAOS_RESULT line (process died or hung)"]})
            d["exit_code"] = rc
            if kill.get("kill_unix_ms") and d.get("error_unix_ms"):
                d["detect_ms_after_kill"] = d["error_unix_ms"] - kill["kill_unix_ms"]
            survivors.append(d)
        ok = (rcs[victim] == 137 if victim < len(rcs) else False) and all(
            s.get("verdict") == "pass" and s.get("exit_code") == 0 for s in survivors)
        runs.append({"run": tag, "phase": m.group(2), "shrink": m.group(3) == "1", "victim": victim,
                     "victim_exit_code": rcs[victim] if victim < len(rcs) else None, "kill": kill,
                     "wall_ms": int(m.group(6)), "survivors": survivors, "verdict": "pass" if ok else "fail"})
steps = [dict(zip(("step", "rc", "seconds"), r.split("|"))) for r in rows]
soak = None
try:
    soak = json.load(open(os.path.join(out, "soak.json")))
except Exception:
    pass
doc = {"tool": "scripts/device/steps/reliability.sh", "commit": os.environ.get("MOELINK_COMMIT"), "steps": steps, "chaos": runs,
       "soak_verdict": soak and soak.get("verdict")}
json.dump(doc, open(os.path.join(out, "reliability.json"), "w"), indent=1)

lines = ["# Reliability run", "", "| step | rc | seconds |", "|---|---|---|"]
lines += [f"| {s['step']} | {s['rc']} | {s['seconds']} |" for s in steps]
lines += ["", "## Kill a rank (process mode)", "",
          "| run | victim exit | survivors: error (peer named / chain end, phase) | failing call ms | detect ms after kill | poisoned | drop ms | rebuilt | verdict |",
          "|---|---|---|---|---|---|---|---|---|"]
for r in runs:
    sv = r["survivors"]
    def col(key, fmt="{}"):
        return ", ".join(fmt.format(s.get(key)) if s.get(key) is not None else "-" for s in sv)
    errs = ", ".join(f"{s.get('error_kind') or 'none'} ({s.get('peer_named')}/{s.get('chain') or s.get('root_cause')}"
                     + (f", {s['timeout_phase']}" if s.get("timeout_phase") else "") + ")" for s in sv)
    if r["shrink"]:
        errs = ", ".join(f"mask {s.get('mask')} ok={s.get('mask_ok')}, slowest {s.get('slowest_call_ms', 0):.0f} ms, "
                         f"{s.get('iterations_done')} it, {s.get('mismatching_iterations')} bad" for s in sv)
    lines.append(f"| {r['run']} | {r['victim_exit_code']} | {errs} | {col('failing_call_ms', '{:.0f}')} | "
                 f"{col('detect_ms_after_kill')} | {col('poisoned_afterwards')} | {col('drop_ms', '{:.0f}')} | "
                 f"{col('recovered')} | **{r['verdict']}** |")
    for s in sv:
        if s.get("reasons"):
            lines.append(f"|  ↳ rank {s.get('rank')} | | {'; '.join(s['reasons'])[:400]} | | | | | | |")
if soak:
    lines += ["", "## Soak", "", f"verdict **{soak['verdict']}**, {soak['rounds_done']} rounds per family in {soak['elapsed_s']:.0f} s"
              + (f" (stopped: {soak['stopped_early']})" if soak.get("stopped_early") else ""), "",
              "| family | rounds | mismatches | graph rounds/replays | no-sync | fp8 |", "|---|---|---|---|---|---|"]
    for f in soak["families"]:
        lines.append(f"| {f['family']} | {f['rounds']} | {f['mismatches']} | {f['graph_rounds']}/{f['graph_replays']} | {f['no_sync_rounds']} | {f['fp8_rounds']} |")
    mib = lambda b: f"{b / 2**20:.1f}"
    for m in soak.get("device_memory", []):
        lines.append(f"- GPU {m['rank']}: start {mib(m['start'])} MiB, after warm-up {mib(m['after_warmup'])}, end {mib(m['end'])}, max {mib(m['max'])} MiB")
    for key, what in [("host_rss", "host RSS"), ("host_heap_in_use", "host heap in use"), ("host_heap_held", "host heap held"),
                      ("host_rss_after_trim", "host RSS after malloc_trim")]:
        h = soak.get(key)
        if h:
            lines.append(f"- {what}: start {mib(h['start'])} MiB, after warm-up {mib(h['after_warmup'])}, end {mib(h['end'])}, max {mib(h['max'])} MiB")
    for e in soak.get("errors", []):
        lines.append(f"- ERROR {e}")
    for f in soak.get("failures", [])[:5]:
        lines.append(f"- MISMATCH {f['family']} round {f['round']} rank {f['rank']}: {f['what'][:300]}")
open(os.path.join(out, "reliability-summary.md"), "w").write("\n".join(lines) + "\n")
PY
echo
echo "================ RELIABILITY SUMMARY ================"
cat "$OUT/reliability-summary.md"
echo "total $(elapsed)s"
