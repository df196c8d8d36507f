#!/usr/bin/env bash
# Step `python` of scripts/device/run.sh (PY_STEPS picks the sub-steps; carry [".device"], whose wheel
# scripts/device/build.sh builds with scripts/build-wheel.sh): installs the wheel and runs
#   1. the CI tests (python/tests: native module, API surface) on this machine's Python,
#   2. the torchrun suite python/tests/gpu on 2 and on 4 GPUs (CUDA backend, NCCL group),
#   3. the same suite on the host backend (CPU tensors, gloo) as a check of the Python layer alone, on one node
#      and, for the high-throughput tests, on 2x2 virtual nodes (DeepEP's internode API),
#   4. examples/moe_layer.py on 4 GPUs,
#   5. python -m moelink.bench on 4 GPUs (moelink vs NCCL, DeepEP if importable),
# writing logs and JSON to $OUT (run.sh's $W/python, packed into its results.tgz) and printing a summary last.
#
# Step `hostcost` (issue 26; carry [".device", ".whl"]: the wheel from scripts/build-wheel.sh, DeepEP's wheel and
# DeepEP's tests in .whl/, see below), about 4 minutes on 2 GPUs:
#   STEPS=python PY_STEPS=hostcost bash scripts/device/run.sh
#   1. python -m moelink.bench --host-cost --graph --reuse-ab at 2 ranks: moelink (with and without output
#      reuse) beside DeepEP (its wheel installed from .whl/), hostcost.log and hostcost.json;
#   2. the Python GPU suite at 2 ranks (gpu-tests-2.log);
#   3. DeepEP's own tests/test_low_latency.py and tests/test_intranode.py (DeepEP 567632d, the wheel's commit;
#      copied into the git-ignored .whl/deepep-tests/ with utils.py, never committed) against moelink imported
#      as deep_ep (a shim package on PYTHONPATH), then against DeepEP itself for the baseline
#      (deepep-tests.log, deepep-baseline.log);
#   4. with HOSTCOST_REPEAT=N, N more runs of the host-cost bench, both systems (below);
#   5. with HOSTCOST_ALTERNATE=N, N alternations of the Rust HT bench and the Python HT host cost (below).
set -uo pipefail
[ -n "${MOELINK_DEVICE_RUN:-}" ] || { echo "$0 is a step of scripts/device/run.sh: STEPS=python bash scripts/device/run.sh" >&2; exit 2; }
cd "$ROOT" || exit 1

# PY_STEPS picks steps (default: all but gpu1, shared, nodes, hostcost and probe).
PY_STEPS=${PY_STEPS:-"ci gpu2 gpu4 host example bench"}
for s in $PY_STEPS; do
    case $s in
    ci | gpu1 | gpu2 | gpu4 | host | shared | nodes | example | bench | hostcost | probe) ;;
    *) echo "python: unknown step '$s' (known: ci gpu1 gpu2 gpu4 host shared nodes example bench hostcost probe)" >&2; exit 2 ;;
    esac
done
if [ -n "${DRY_RUN:-}" ]; then echo "python: would run $PY_STEPS"; exit 0; fi

OUT=${OUT:-/tmp/moelink-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MOELINK_TIMEOUT_MS=${MOELINK_TIMEOUT_MS:-5000}
# A suite test running longer than this is taken for a hang: stacks printed, the suite stopped (conftest.py).
export MOELINK_TEST_DEADLINE_S=${MOELINK_TEST_DEADLINE_S:-45}
MOELINK_COMMIT=${MOELINK_COMMIT:-$(sed -n 's/^commit: //p' .device/manifest.txt 2>/dev/null)}
MOELINK_COMMIT=${MOELINK_COMMIT:-unknown}
export MOELINK_COMMIT
export OMP_NUM_THREADS=4
# PY_CONNECTIONS: CUDA_DEVICE_MAX_CONNECTIONS for this step ("default": unset, the driver's 8). run.sh gives every
# step 32, which only ranks sharing a GPU in one process need; these steps run one rank per process.
case ${PY_CONNECTIONS:-} in
    "") ;;
    default) unset CUDA_DEVICE_MAX_CONNECTIONS ;;
    *) export CUDA_DEVICE_MAX_CONNECTIONS=$PY_CONNECTIONS ;;
esac
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
# An instance given some of the GPUs (CUDA_VISIBLE_DEVICES) counts only those.
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
ranks=$ngpu
if [ "$ngpu" -eq 0 ]; then  # a machine without GPUs: everything on the host backend (a dry run of this script)
    export MOELINK_BACKEND=host
    ranks=2
fi

summary="$OUT/summary.txt"
: > "$summary"
step() {  # step NAME LOG TIMEOUT CMD...: runs CMD, records its exit status and the pytest/PASS line
    local name=$1 log=$2 limit=$3
    shift 3
    local start=$SECONDS
    timeout "$limit" "$@" >> "$log" 2>&1
    local rc=$?
    local last
    last=$(grep -E "passed|failed|error|PASS|FAIL|^bench records" "$log" | tail -n 1)
    printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" "$last" >> "$summary"
    return "$rc"
}

{
    echo "commit $MOELINK_COMMIT, $(date -u +%FT%TZ), $ngpu GPUs, CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"
    nvidia-smi -L 2>/dev/null
    python3 --version
    python3 -m pip install -q --no-index --no-deps --target "$SCRATCH/site" .device/moelink-*.whl && echo "installed $(ls .device/moelink-*.whl)"
} > "$OUT/setup.log" 2>&1
export PYTHONPATH=$SCRATCH/site
python3 -c "import moelink, torch; print('moelink', moelink.__version__, 'torch', torch.__version__); print(moelink._native.cuda_info()); print('is_sm90_compiled', moelink.Buffer.is_sm90_compiled())" >> "$OUT/setup.log" 2>&1

want() { case " $PY_STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
want ci && (cd python/tests && step "ci tests (python/tests)" "$OUT/setup.log" 120 python3 -m pytest -q -p no:cacheprovider .)
tr=(torchrun --standalone --local-ranks-filter 0)
suite=(-m pytest -q -p no:cacheprovider -rfEs --durations=15 python/tests/gpu)  # per-test times in the log
for n in 1 2 4; do  # gpu1 (one rank, not in the default steps): for a machine with one GPU
    if [ "$ngpu" -ge "$n" ] && want "gpu$n"; then
        step "gpu suite, $n ranks (cuda)" "$OUT/gpu-tests-$n.log" 120 "${tr[@]}" --nproc_per_node="$n" "${suite[@]}"
    fi
done
want host && MOELINK_BACKEND=host step "suite, 4 ranks (host, cpu)" "$OUT/host-tests.log" 120 \
    "${tr[@]}" --nproc_per_node=4 "${suite[@]}"
# The high-throughput tests across nodes (DeepEP's internode API: per-node counts, the 10-element handle) on
# the host backend: the Python layer's internode path without a GPU.
ht_tests=(python/tests/gpu/test_ht.py python/tests/gpu/test_handles.py -k "not test_ll_")
want host && MOELINK_BACKEND=host MOELINK_TOPOLOGY=2x2 step "ht 2x2, 4 ranks (host, cpu)" "$OUT/host-tests.log" 120 \
    "${tr[@]}" --nproc_per_node=4 -m pytest -q -p no:cacheprovider -rfEs "${ht_tests[@]}"
# shared / nodes: 4 processes on ONE GPU under CUDA MPS (started as an ordinary daemon, pipe and log under $SCRATCH,
# quit at the end; compute mode untouched), a gloo group: the whole suite intranode, then on 2x2 virtual nodes
# over each transport the low-latency tests and the high-throughput ones (test_ht.py and the HT handle tests:
# DeepEP's internode API on the internode kernels; first calls JIT-compile their variants, NVSHMEM's slowly,
# hence the longer per-test deadline). Ranks share the GPU: no figure here is an NVLink or network one.
# Processes sharing one GPU run under CUDA MPS, started as an ordinary daemon (pipe and log under $SCRATCH) and
# quit at the end of the step that started it; compute mode untouched.
mps_start() {
    export CUDA_MPS_PIPE_DIRECTORY=$SCRATCH/mps-pipe CUDA_MPS_LOG_DIRECTORY=$SCRATCH/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS daemon started" >> "$OUT/setup.log"
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
}
mps_stop() {
    echo quit | nvidia-cuda-mps-control
    trap - EXIT
}
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
# MPS_THREAD_PERCENTAGE (unset by default) limits each process: moelink still divides what a process sees
# among all the ranks on the GPU, so a limit leaves each rank less.
# One rank per process: no extra hardware queues (four MPS clients asking for run.sh's 32 each fail to create
# their contexts: CUDA_ERROR_OUT_OF_MEMORY; two work). NVSHMEM's PEs on one GPU: no remote transport.
shared_env=(env -u CUDA_DEVICE_MAX_CONNECTIONS ${MPS_THREAD_PERCENTAGE:+CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$MPS_THREAD_PERCENTAGE} NVSHMEM_HOME="${NVSHMEM_HOME:-$nv}" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1)
if want shared || want nodes; then
    mps_start
    want shared && step "suite, 4 ranks on 1 GPU (mps)" "$OUT/shared-tests.log" 300 \
        "${shared_env[@]}" "${tr[@]}" --nproc_per_node=4 "${suite[@]}"
    for transport in ${NODE_TRANSPORTS:-emu-nic ptr nvshmem}; do
        want nodes && step "ll 2x2 $transport (mps)" "$OUT/nodes-$transport.log" 240 \
            "${shared_env[@]}" MOELINK_TOPOLOGY=2x2 MOELINK_TRANSPORT="$transport" "${tr[@]}" --nproc_per_node=4 \
            -m pytest -q -p no:cacheprovider -rfEs python/tests/gpu/test_ll.py
        want nodes && step "ht 2x2 $transport (mps)" "$OUT/nodes-$transport.log" 420 \
            "${shared_env[@]}" MOELINK_TOPOLOGY=2x2 MOELINK_TRANSPORT="$transport" MOELINK_TEST_DEADLINE_S=120 \
            "${tr[@]}" --nproc_per_node=4 -m pytest -q -p no:cacheprovider -rfEs --durations=10 "${ht_tests[@]}"
    done
    mps_stop
fi
want example && step "examples/moe_layer.py, $ranks ranks" "$OUT/moe_layer.log" 120 "${tr[@]}" --nproc_per_node="$ranks" examples/moe_layer.py
bench_args=()
[ "$ngpu" -eq 0 ] && bench_args=(--tokens 256 --hidden 512 --experts 16 --ll-tokens 16 --ll-experts 16 --reps 3 --warmup 1)
want bench && step "bench, $ranks ranks" "$OUT/bench.log" 240 \
    "${tr[@]}" --nproc_per_node="$ranks" -m moelink.bench --json "$OUT/bench-python.json" "${bench_args[@]}"

# HOSTCOST_RANKS: the host-cost bench's, the probe's and DeepEP's tests' ranks (default 2). With fewer GPUs
# than that, they run their ranks on the GPUs there are, under MPS, each process held to its share of the SMs
# (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, unless MPS_THREAD_PERCENTAGE says otherwise: collective kernels of
# processes sharing a GPU must be resident together, and DeepEP sizes its kernels to the SMs it sees). DeepEP's
# tests then run through scripts/device/share_gpus (a gloo group, rank r on GPU r mod n). DeepEP's low-latency
# kernels, sized from the SMs the CUDA runtime reports (the MPS share), time out there: they run when told fewer
# with share_gpus/share_sms.c preloaded (MOELINK_SHARE_GPUS_SMS). DEEPEP_LL_SMS lists the counts to try, largest
# first (default "36 30 24": two processes on one H200 at 50 % time out told 58, 48 or 42 and pass told 36); the
# first at which DeepEP's own test_low_latency passes joins hc_env, and if none does, the bench records DeepEP's
# LL ops unavailable.
# moelink reads the SMs through the driver API, which the preload leaves alone.
# Host time per call is the CPU's; loops, syncs and the tests' timings are GPU-sharing figures.
hc_ranks=${HOSTCOST_RANKS:-2}
hc_env=()
hc_shared=0
if [ "$ngpu" -ge 1 ] && [ "$ngpu" -lt "$hc_ranks" ]; then
    hc_shared=1
    hc_percentage=${MPS_THREAD_PERCENTAGE:-$((100 * ngpu / hc_ranks))}
    hc_env=("${shared_env[@]}" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$hc_percentage")
elif [ "$ngpu" -lt "$hc_ranks" ]; then
    hc_ranks=$ranks
fi
if want hostcost || want probe; then
    # DeepEP beside moelink: its wheel for this image (../shared/baselines/README.md), carried in .whl/.
    if ls .whl/deep_ep-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target "$SCRATCH/deepep-site" .whl/deep_ep-*.whl \
            && echo "installed $(ls .whl/deep_ep-*.whl)" >> "$OUT/setup.log"
    else
        echo "no DeepEP wheel in .whl/: moelink alone" >> "$OUT/setup.log"
    fi
    if [ "$hc_shared" = 1 ] && ! cc -shared -fPIC -O2 -I"${CUDA_HOME:-/usr/local/cuda}/include" \
        scripts/device/share_gpus/share_sms.c -o "$SCRATCH/libshare_sms.so" -ldl >> "$OUT/setup.log" 2>&1; then
        echo "share_sms: not built; DeepEP's LL ops will be recorded unavailable" >> "$OUT/setup.log"
    fi
fi
# Step `probe`: scripts/device/launch_cost.py, the host time of each piece of an eager call (torch's queries, a
# launch on the default and on a side stream), both systems (launch-cost.log, launch-cost.json).
if want probe && [ "$ngpu" -ge 1 ]; then
    PYTHONPATH=$SCRATCH/deepep-site:$PYTHONPATH step "launch cost probe" "$OUT/launch-cost.log" 120 \
        "${tr[@]}" --nproc_per_node="$hc_ranks" scripts/device/launch_cost.py --json "$OUT/launch-cost.json"
    cat "$OUT/launch-cost.log"
fi

tests=.whl/deepep-tests
if want hostcost; then
    hc_args=(--host-cost --graph --reuse-ab --json "$OUT/hostcost.json")
    [ "$ngpu" -eq 0 ] && hc_args=(--host-cost --quick --reuse-ab --json "$OUT/hostcost.json")
    [ ${#hc_env[@]} -gt 0 ] && mps_start
    if [ "$hc_shared" = 1 ] && [ -f "$SCRATCH/libshare_sms.so" ] && [ -f "$tests/test_low_latency.py" ] \
        && [ -d "$SCRATCH/deepep-site/deep_ep" ]; then
        # DeepEP's own test decides the SM count its low-latency kernels are told (a hang leaves MPS refusing
        # clients, so MPS restarts after each failure).
        for sms in ${DEEPEP_LL_SMS:-36 30 24}; do
            share_sms_env=(LD_PRELOAD="$SCRATCH/libshare_sms.so" MOELINK_SHARE_GPUS_SMS="$sms")
            echo "== test_low_latency.py against DeepEP (baseline), ranks sharing a GPU, told $sms SMs" >> "$OUT/deepep-baseline.log"
            if (cd "$tests" && PYTHONPATH=$ROOT/scripts/device/share_gpus:$SCRATCH/deepep-site:$PYTHONPATH MASTER_PORT=8391 \
                    step "DeepEP test_low_latency (DeepEP, $sms SMs)" "$OUT/deepep-baseline.log" 75 \
                    "${hc_env[@]}" "${share_sms_env[@]}" MOELINK_SHARE_GPUS=1 python3 test_low_latency.py --num-processes "$hc_ranks"); then
                hc_env+=("${share_sms_env[@]}")
                echo "share_sms: DeepEP's test_low_latency passes told $sms SMs" >> "$OUT/setup.log"
                break
            fi
            echo "share_sms: DeepEP's test_low_latency fails told $sms SMs" >> "$OUT/setup.log"
            pkill -9 -f test_low_latency.py; sleep 1  # timeout stops the spawner; its ranks hold MPS clients
            mps_stop
            mps_start
        done
    fi
    PYTHONPATH=$SCRATCH/deepep-site:$PYTHONPATH step "host cost, $hc_ranks ranks" "$OUT/hostcost.log" 150 \
        "${hc_env[@]}" "${tr[@]}" --nproc_per_node="$hc_ranks" -m moelink.bench "${hc_args[@]}"
    if [ "$ngpu" -ge 2 ] && ! want gpu2; then
        step "gpu suite, 2 ranks (cuda)" "$OUT/gpu-tests-2.log" 150 "${tr[@]}" --nproc_per_node=2 "${suite[@]}"
    elif [ "$hc_shared" = 1 ]; then
        step "gpu suite, $hc_ranks ranks on $ngpu GPU(s) (mps)" "$OUT/gpu-tests-2.log" 200 \
            "${shared_env[@]}" "${tr[@]}" --nproc_per_node="$hc_ranks" "${suite[@]}"
    fi
    # DeepEP's own tests, unchanged, against moelink as deep_ep: a shim package that re-exports moelink.
    share=()  # ranks sharing the GPUs: DeepEP's tests through scripts/device/share_gpus, in hc_env
    [ "$hc_shared" = 1 ] && share=("${hc_env[@]}" MOELINK_SHARE_GPUS=1)
    share_path=$ROOT/scripts/device/share_gpus:
    [ "$hc_shared" = 1 ] || share_path=
    if [ -f "$tests/test_low_latency.py" ] && { [ "$ngpu" -ge 2 ] || [ "$hc_shared" = 1 ]; }; then
        shim=$SCRATCH/deepep-shim/deep_ep
        mkdir -p "$shim"
        printf 'from moelink import *  # noqa: F401,F403 - DeepEP tests run against moelink\nfrom moelink import Buffer, Config, EventOverlap, topk_idx_t  # noqa: F401\n' > "$shim/__init__.py"
        for t in test_low_latency test_intranode; do
            echo "== $t.py against moelink (deep_ep = moelink), DeepEP $(cat "$tests/COMMIT" 2>/dev/null)" >> "$OUT/deepep-tests.log"
            (cd "$tests" && PYTHONPATH=$share_path$SCRATCH/deepep-shim:$PYTHONPATH MASTER_PORT=8371 \
                step "DeepEP $t (moelink)" "$OUT/deepep-tests.log" 120 "${share[@]}" python3 "$t.py" --num-processes "$hc_ranks")
        done
        if [ -d "$SCRATCH/deepep-site/deep_ep" ]; then
            baseline=(test_low_latency test_intranode)
            [ "$hc_shared" = 1 ] && baseline=(test_intranode)  # its low-latency test ran above, with share_sms
            for t in "${baseline[@]}"; do
                echo "== $t.py against DeepEP (baseline)" >> "$OUT/deepep-baseline.log"
                (cd "$tests" && PYTHONPATH=$share_path$SCRATCH/deepep-site:$PYTHONPATH MASTER_PORT=8381 \
                    step "DeepEP $t (DeepEP)" "$OUT/deepep-baseline.log" 100 "${share[@]}" python3 "$t.py" --num-processes "$hc_ranks")
            done
        fi
    fi
    # HOSTCOST_REPEAT=N: N more runs of the host-cost bench, both systems, every op (hostcost-rep-I.json): one
    # host's noise moves both systems' figures, so the ratios are read from several runs of the same call.
    for i in $(seq 1 "${HOSTCOST_REPEAT:-0}"); do
        PYTHONPATH=$SCRATCH/deepep-site:$PYTHONPATH step "host cost, repeat $i" "$OUT/hostcost-rep.log" 120 \
            "${hc_env[@]}" "${tr[@]}" --nproc_per_node="$hc_ranks" -m moelink.bench --host-cost --json "$OUT/hostcost-rep-$i.json"
    done
    # HOSTCOST_ALTERNATE=N: the fresh HT dispatch's bound (Python within 30 us of the Rust bench at the same
    # shape), N alternations on this machine of the Rust bench and the Python one (rust-ht-I.json, py-ht-I.json).
    # With ranks sharing a GPU the Rust bench runs as the Python one does: a process per rank, in hc_env.
    rust_ht=("$BIN" bench --mode ht --ranks "$hc_ranks")
    [ "$hc_shared" = 1 ] && rust_ht=("${hc_env[@]}" "${tr[@]}" --nproc_per_node="$hc_ranks" --no-python "$BIN" bench --process
        --mode ht --ranks "$hc_ranks" --topology "1x$hc_ranks")
    for i in $(seq 1 "${HOSTCOST_ALTERNATE:-0}"); do
        step "rust ht bench ($i)" "$OUT/alternate.log" 60 "${rust_ht[@]}" --reps 30 --json "$OUT/rust-ht-$i.json"
        step "python ht host cost ($i)" "$OUT/alternate.log" 90 \
            "${hc_env[@]}" "${tr[@]}" --nproc_per_node="$hc_ranks" -m moelink.bench --host-cost --ops ht --systems moelink \
            --json "$OUT/py-ht-$i.json"
    done
    [ ${#hc_env[@]} -gt 0 ] && mps_stop
    echo "== host cost"
    sed -n '/^moelink bench --host-cost/,$p' "$OUT/hostcost.log" | head -80
    echo "== DeepEP's tests (moelink, then DeepEP): timings"
    grep -hE "^\[rank 0\]|\[tuning\] Best|\[layout\]|passed|Error|assert" "$OUT/deepep-tests.log" "$OUT/deepep-baseline.log" 2>/dev/null | head -40
fi

echo "== bench table"
sed -n '/^moelink bench/,$p' "$OUT/bench.log" 2>/dev/null | head -40
echo "== summary (logs in \$OUT)"
cat "$summary"
