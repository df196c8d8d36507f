#!/usr/bin/env bash
# Step `internode` of scripts/device/run.sh (INTERNODE_STEPS picks the sub-steps below; any GPU machine, one
# GPU is enough): the internode work on virtual nodes, with ranks sharing the GPU(s). Correctness and the transport seam only:
# there is no RDMA NIC, and ranks on one GPU exchange through its own memory, so nothing here is a network
# or NVLink figure.
#   seam      thread mode: the internode GPU tests (transport conformance on ptr / emu-nic, buffers over
#             2x2, 2x4, 4x2 virtual nodes, a missing rank named), moelink selftest with the transport checks,
#             moelink bench transport at 4 ranks as 2x2 (ptr, emu-nic)
#   nomps     process mode without CUDA MPS: moelink selftest --process with 2 processes on one GPU (each rank
#             prints its own failures)
#   mps       CUDA MPS started as an ordinary daemon (pipe and log folders under $SCRATCH, compute mode untouched,
#             CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / processes), quit at the end: moelink selftest --process
#             with the nvshmem transport at 2 and 4 processes, moelink bench transport --process (nvshmem,
#             ptr, emu-nic) at 4 processes as 2x2, and moelink bench --process (HT and LL, nvshmem) at 4
#             processes as 2x2
#   mpsthread thread mode under MPS: the HT test that timed out there (cuda::timed_regions_keep_results_and_measure)
#             at 4 ranks: refused with CUDA's default hardware work queues (the error says why), run with
#             CUDA_DEVICE_MAX_CONNECTIONS=32 (what run.sh gives every other step)
#   ll        thread mode: low-latency dispatch and combine across 2x2, 2x4 and 4x2 virtual nodes on ptr and
#             emu-nic against the host backend (tests/ll_internode_gpu.rs)
#   bench     thread mode: moelink bench --mode ll --hook (DeepEP's LL shape) at 4 ranks as 1x4 (the intranode
#             kernels), 2x2 over ptr and emu-nic, and 2x2 over ptr without NVLink inside a node; records with the
#             byte model's RDMA and NVLink bytes. Four ranks share one GPU: not network latency
#   soak      thread mode: moelink-stress soak of the LL families on 2x2 virtual nodes over emu-nic (reordering
#             across QPs), SOAK_S seconds (default 300), up to SOAK_ROUNDS rounds per family (default 5000)
#   ht        thread mode: high-throughput dispatch and combine across 2x2, 2x4 and 4x2 virtual nodes on ptr and
#             emu-nic against the host backend on one node, several rounds per call, and a silent rank named
#             (tests/ht_internode.rs, its cuda:: tests)
#   htchaos   process mode: 4 processes under MPS as 2x2 virtual nodes (steps/reliability.sh with
#             RANKS=4), rank 3 SIGKILLed inside an HT dispatch and an HT combine, once per transport of
#             HT_CHAOS_TRANSPORTS (default "emu-nic nvshmem"), HT_CHAOS_RUNS (default "ht-dispatch ht-combine"; add
#             ll-dispatch ll-combine for the low-latency kills across nodes); each transport's files under htchaos-<transport>/ in
#             results.tgz, the verdicts in the summary
#   htsoak    thread mode: moelink-stress soak of the HT families (ht, ht-cached) on 2x2 virtual nodes over
#             emu-nic (reordering across QPs), buffers for rounds smaller than the calls: HT_SOAK_ROUNDS rounds per
#             family (default 2000) within HT_SOAK_S seconds (default 300, less when BUDGET_S leaves less; the
#             rounds done are in the summary), HT_SOAK_ARGS (default "--hidden 2048,7168": fewer kernel variants
#             to compile, more rounds)
# The HT steps in one call (about 9 minutes; the soak takes what the others leave of BUDGET_S):
#   STEPS=internode INTERNODE_STEPS="ht htchaos htsoak" T_INTERNODE=560 bash scripts/device/run.sh
# NVSHMEM is torch's (nvidia-nvshmem-cu13 3.4.5) unless NVSHMEM_HOME says otherwise; single-host settings:
# NVSHMEM_REMOTE_TRANSPORT=none, the unique-id bootstrap on lo.
#
# run.sh gives it OUT, W (its work folder), STEPS (from INTERNODE_STEPS) and BUDGET_S. Every sub-step's log
# and JSON lands in $W, packed into $OUT/results.tgz after each sub-step (a call cut short still returns the
# logs), with one line per run in $OUT/summary.txt, printed last.
set -uo pipefail
[ -n "${MOELINK_DEVICE_RUN:-}" ] || { echo "$0 is a step of scripts/device/run.sh: STEPS=internode bash scripts/device/run.sh" >&2; exit 2; }
cd "$ROOT" || exit 1
STEPS=${STEPS:-"seam nomps mps mpsthread ll bench soak"}
for s in $STEPS; do
    case $s in
    seam | nomps | mps | mpsthread | ll | bench | soak | ht | htchaos | htsoak) ;;
    *) echo "internode: unknown step '$s' (known: seam nomps mps mpsthread ll bench soak ht htchaos htsoak)" >&2; exit 2 ;;
    esac
done
if [ -n "${DRY_RUN:-}" ]; then echo "internode: would run $STEPS"; exit 0; fi
mkdir -p "$OUT"
rm -rf "$W" && mkdir -p "$W/bin"
# run.sh's environment (NVLS off, CUDA_DEVICE_MAX_CONNECTIONS, LD_LIBRARY_PATH, MOELINK_COMMIT, the JIT cache)
# holds here; the binaries are copied into this step's work folder.
BIN=$W/bin/moelink
cp .device/moelink "$BIN" && chmod +x "$BIN"
STRESS=$W/bin/moelink-stress
cp .device/moelink-stress "$STRESS" && chmod +x "$STRESS"
summary=$OUT/summary.txt
{ echo "commit $MOELINK_COMMIT, $(date -u +%FT%TZ)"; nvidia-smi -L; } > "$summary"
BUDGET_S=${BUDGET_S:-570}
note() { echo "$*" | tee -a "$summary"; }
# run NAME LIMIT CMD...: output to $W/NAME.log, status and time to the summary. BUDGET_S bounds the whole
# step: a run's limit shrinks to what is left, and a run that no longer fits is skipped.
run() {
    local name=$1 limit=$2 start=$SECONDS left=$((BUDGET_S - SECONDS - 15))
    shift 2
    if [ "$left" -lt 20 ]; then
        note "$(printf '%-16s skipped (BUDGET_S=%s used up)' "$name" "$BUDGET_S")"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout --kill-after=10 "$limit" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    note "$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^test result|^soak: |^wrote|passed|PASS|FAIL' "$W/$name.log" | tail -n 1)")"
}
export MOELINK_TEST_TIMEOUT_MS=${MOELINK_TEST_TIMEOUT_MS:-5000}
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
export NVSHMEM_HOME=${NVSHMEM_HOME:-$nv} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1
note "ranks share GPUs: $(nvidia-smi -L | wc -l) GPU(s); NVSHMEM_HOME=$NVSHMEM_HOME"
export CUDA_MPS_PIPE_DIRECTORY=$SCRATCH/mps-pipe CUDA_MPS_LOG_DIRECTORY=$SCRATCH/mps-log
mps_on=0
mps_start() {
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps_on=1 && note "MPS daemon started"
}
mps_stop() {
    if [ "$mps_on" = 1 ]; then
        echo quit | nvidia-cuda-mps-control
        mps_on=0
        note "MPS daemon quit"
    fi
}
trap mps_stop EXIT
test_bin() {  # test_bin NAME RANKS EXECUTABLE [FILTER...]
    local name=$1 ranks=$2 exe=$3
    shift 3
    local crate=${exe%%.*}
    cp ".device/tests/$exe" "$W/bin/$exe" && chmod +x "$W/bin/$exe"
    run "$name" 300 env -C "crates/$crate" MOELINK_TEST_RANKS="$ranks" "$W/bin/$exe" --include-ignored --test-threads=1 "$@"
}
trun() {  # trun NAME PROCESSES LIMIT ARGS...: moelink ARGS under torchrun, one process per rank
    local name=$1 n=$2 limit=$3
    shift 3
    # One rank per process needs no extra hardware queues, and four MPS clients that each ask for run.sh's 32
    # fail to create their contexts (CUDA_ERROR_OUT_OF_MEMORY; two work).
    run "$name" "$limit" env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) \
        torchrun --standalone --nproc_per_node="$n" --no-python "$BIN" "$@"
}
for s in $STEPS; do
    case $s in
    seam)
        test_bin internode-tests 4 moelink.test.internode_gpu
        run selftest-threads 180 "$BIN" selftest --ranks 4 --transport ptr,emu-nic --bytes-per-peer $((8 << 20)) --barrier-iters 200
        run bench-threads 240 "$BIN" bench transport --ranks 4 --topology 2x2 --transport ptr,emu-nic --qps 1,4 \
            --sizes 16,4096,65536,1048576 --json "$W/transport-threads-2x2.json"
        ;;
    nomps)
        trun selftest-p2-nomps 2 180 selftest --process --transport ptr,emu-nic --bytes-per-peer $((8 << 20)) --barrier-iters 100
        ;;
    mps)
        mps_start
        trun selftest-p2-mps 2 240 selftest --process --transport ptr,emu-nic,nvshmem --bytes-per-peer $((8 << 20)) --barrier-iters 200
        trun selftest-p4-mps 4 240 selftest --process --transport ptr,emu-nic,nvshmem --bytes-per-peer $((8 << 20)) --barrier-iters 200
        trun bench-p4-mps 4 240 bench transport --process --topology 2x2 --transport nvshmem,ptr,emu-nic --qps 1,4 \
            --sizes 16,4096,65536,1048576 --json "$W/transport-process-2x2.json"
        # HT and LL at DeepEP's shapes, 4 NVSHMEM PEs as 2x2 virtual nodes, checked against the host backend
        # before timing (ranks share GPUs: not a network figure).
        trun procbench-p4-mps 4 300 bench --process --topology 2x2 --transport nvshmem --mode all --reps 5 \
            --json "$W/procbench-2x2-nvshmem-mps.json"
        mps_stop
        ;;
    mpsthread)
        mps_start
        cp .device/tests/moelink.test.ht $W/bin/ht && chmod +x $W/bin/ht
        for conn in default 32; do
            connections=(-u CUDA_DEVICE_MAX_CONNECTIONS); [ $conn != default ] && connections=("CUDA_DEVICE_MAX_CONNECTIONS=$conn")
            run "mps-thread-conn-$conn" 60 env -C crates/moelink "${connections[@]}" MOELINK_TEST_RANKS=4 \
                $W/bin/ht --include-ignored --test-threads=1 --exact cuda::timed_regions_keep_results_and_measure
        done
        mps_stop
        ;;
    ll)
        test_bin ll-internode-tests 8 moelink.test.ll_internode_gpu
        ;;
    bench)
        for v in "1x4 ptr" "2x2 ptr" "2x2 emu-nic" "2x2 ptr --no-nvlink-in-node"; do
            set -- $v
            name="bench-ll-$1-$2${3:+-no-nvlink}"
            run "$name" 240 "$BIN" bench --backend cuda --mode ll --hook --ranks 4 --topology "$1" --transport "$2" ${3:-} \
                --reps "${BENCH_REPS:-30}" --json "$W/$name.json"
        done
        ;;
    ht)
        test_bin ht-internode-tests 8 moelink.test.ht_internode
        ;;
    htchaos)
        mps_stop  # reliability.sh starts (and quits) its own daemon for more ranks than GPUs
        port=29600
        for tr in ${HT_CHAOS_TRANSPORTS:-emu-nic nvshmem}; do
            # Two runs of at most 65 s each (60 s per process: the first compiles the kernels; then the kill),
            # MPS and the summary; a run takes 5-30 s when it passes.
            limit=145 left=$((BUDGET_S - SECONDS - 15))
            [ "$limit" -gt "$left" ] && limit=$left
            run "htchaos-$tr" "$limit" env OUT="$W/htchaos-$tr" BUDGET_S=$((limit - 10)) RANKS=4 VICTIM=3 STEPS=chaos CHAOS_T_S=60 \
                CHAOS_RUNS="${HT_CHAOS_RUNS:-ht-dispatch ht-combine}" CHAOS_PORT_BASE=$port CHAOS_ARGS="--topology 2x2 --transport $tr" \
                bash scripts/device/steps/reliability.sh
            note "$(python3 - "$W/htchaos-$tr/reliability.json" "$tr" <<'PY' 2>&1
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["chaos"]
except Exception as e:
    print(f"  htchaos {sys.argv[2]}: no reliability.json ({e})"); sys.exit()
for r in runs:
    sv = ", ".join(f"r{s.get('rank')} {s.get('error_kind')} {s.get('timeout_phase')} peer {s.get('peer_named')} ({s.get('chain')})"
                   for s in r["survivors"])
    print(f"  htchaos {sys.argv[2]} {r['phase']}: {r['verdict'].upper()} | {sv}")
PY
)"
            port=$((port + 100))
        done
        ;;
    htsoak)
        # The soak's own budget: HT_SOAK_S, or what BUDGET_S leaves after 60 s for start-up and the summary.
        budget=${HT_SOAK_S:-300} left=$((BUDGET_S - SECONDS - 15 - 60))
        [ "$budget" -gt "$left" ] && budget=$left
        if [ "$budget" -lt 30 ]; then
            note "$(printf '%-16s skipped (%ss of BUDGET_S=%s left)' soak-ht-2x2 "$left" "$BUDGET_S")"
        else
            run soak-ht-2x2-emu-nic $((budget + 60)) "$STRESS" soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
                --families ht,ht-cached --rounds "${HT_SOAK_ROUNDS:-2000}" --time-budget-s "$budget" --progress-s 30 \
                --json "$W/soak-ht-2x2-emu-nic.json" ${HT_SOAK_ARGS:---hidden 2048,7168}
            note "$(python3 - "$W/soak-ht-2x2-emu-nic.json" <<'PY' 2>&1
import json, sys
try:
    v = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"  soak-ht: no summary ({e})"); sys.exit()
st = v["settings"]
print(f"  soak-ht {v['verdict'].upper()}: {v['rounds_done']} rounds per family in {v['elapsed_s']:.0f} s "
      f"({st['nodes']}x{st['ranks_per_node']} over {st['transport']}, buffers for rounds of {st['ht_round_tokens']} tokens "
      f"at the largest hidden, chunks of {st['ht_chunk_tokens']}), {v['total_mismatches']} mismatches"
      + (f", stopped: {v['stopped_early']}" if v.get("stopped_early") else ""))
for f in v["families"]:
    print(f"  {f['family']}: {f['rounds']} rounds, {f['mismatches']} mismatches, multi-round {f['multi_round_rounds']} "
          f"(most {f['most_rounds_per_call']}), node-limited {f['node_limited_rounds']}, empty node {f['empty_node_rounds']}, "
          f"skewed node {f['node_skewed_rounds']}, silent node {f['silent_node_rounds']}, empty rank {f['empty_rank_rounds']}, "
          f"no-sync {f['no_sync_rounds']}, fp8 {f['fp8_rounds']}, graph {f['graph_rounds']}/{f['graph_replays']}")
for e in v.get("errors", [])[:3]:
    print(f"  ERROR {e[:300]}")
PY
)"
        fi
        ;;
    soak)
        run soak-ll-2x2-emu-nic $((${SOAK_S:-300} + 120)) "$STRESS" soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
            --families ll,ll-prereduced,ll-hook --rounds "${SOAK_ROUNDS:-5000}" --time-budget-s "${SOAK_S:-300}" \
            --json "$W/soak-ll-2x2-emu-nic.json"
        note "$(python3 - "$W/soak-ll-2x2-emu-nic.json" <<'PY' 2>&1
import json, sys
try:
    v = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"  soak-ll: no summary ({e})"); sys.exit()
print(f"  soak-ll {v['verdict'].upper()}: {v['rounds_done']} rounds per family in {v['elapsed_s']:.0f} s, "
      f"{v['total_mismatches']} mismatches" + (f", stopped: {v['stopped_early']}" if v.get("stopped_early") else ""))
for f in v["families"]:
    print(f"  {f['family']}: {f['rounds']} rounds, {f['mismatches']} mismatches")
PY
)"
        ;;
    esac
    tar czf "$OUT/results.tgz" --exclude="$(basename "$W")/bin" -C "$(dirname "$W")" "$(basename "$W")"
done
echo "== summary"
cat "$summary"
