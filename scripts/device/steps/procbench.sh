#!/usr/bin/env bash
# Step `procbench` of scripts/device/run.sh: moelink bench --process under torchrun, PROCBENCH_RANKS
# processes (default 2: one per GPU of the first two) as that many virtual nodes of one rank, once per
# transport of PROCBENCH_TRANSPORTS (default "nvshmem emu-nic"), with PROCBENCH_ARGS (default: HT and LL at
# DeepEP's shapes, 10 repetitions): the internode kernels between real GPUs, NVLink standing in for RDMA.
# Writes $OUT/procbench-<transport>.json.
set -u
[ -n "${MOELINK_DEVICE_RUN:-}" ] || { echo "$0 is a step of scripts/device/run.sh: STEPS=procbench bash scripts/device/run.sh" >&2; exit 2; }
n=${PROCBENCH_RANKS:-2}
if [ -n "${DRY_RUN:-}" ]; then echo "procbench: would run $n processes over ${PROCBENCH_TRANSPORTS:-nvshmem emu-nic}"; exit 0; fi
# NVSHMEM as the internode step finds it: torch's wheel, single-host settings.
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
export NVSHMEM_HOME=${NVSHMEM_HOME:-$nv} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1
# More processes than GPUs: they share the GPUs under CUDA MPS (an ordinary daemon, pipe and log under
# $SCRATCH, quit at the end; compute mode untouched), each held to its share of the SMs, since the ranks'
# collective kernels must be resident together. Their times are GPU-sharing figures, not NVLink ones.
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
share=()
if [ "$ngpu" -ge 1 ] && [ "$ngpu" -lt "$n" ]; then
    export CUDA_MPS_PIPE_DIRECTORY=$SCRATCH/mps-pipe CUDA_MPS_LOG_DIRECTORY=$SCRATCH/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "procbench: MPS daemon started ($n processes on $ngpu GPUs)"
    trap 'echo quit | nvidia-cuda-mps-control; echo "procbench: MPS daemon quit"' EXIT
    # One rank per process needs no extra hardware queues (run.sh's 32 per MPS client can exhaust them).
    share=(env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 * ngpu / n)))
fi
for tr in ${PROCBENCH_TRANSPORTS:-nvshmem emu-nic}; do
    echo "--- procbench over $tr"
    # shellcheck disable=SC2086 # PROCBENCH_ARGS is a list of options
    "${share[@]}" torchrun --standalone --nproc_per_node="$n" --no-python "$BIN" bench --process --backend cuda \
        --ranks "$n" --topology "${n}x1" --transport "$tr" ${PROCBENCH_ARGS:---mode all --reps 10} \
        --json "$OUT/procbench-$tr.json" || rc=$?
done
exit "${rc:-0}"
