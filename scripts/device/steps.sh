# Sourced by scripts/device/internode.sh after `cd` to the repository
# root: the binaries under /tmp ($BIN: moelink, $STRESS: moelink-stress), the environment every GPU run keeps (NVLS off), the work folder $W, the summary
# file ($OUT/summary.txt, started with the commit and the GPUs) and `run` / `note`. BUDGET_S (default 570)
# bounds the whole call: `run` shortens a step's limit to what is left and skips a step that no longer fits,
# so the summary always comes back inside the device tool's 600 s.
OUT=${OUT:-/tmp/moelink-out}
mkdir -p "$OUT"
# The work folder: W (run.sh gives each sub-script its own, so that two can run side by side on other GPUs).
W=${W:-/tmp/results}
rm -rf "$W" && mkdir -p "$W/bin"
BIN=$W/bin/moelink
cp .device/moelink "$BIN" && chmod +x "$BIN"
STRESS=$W/bin/moelink-stress
cp .device/moelink-stress "$STRESS" && chmod +x "$STRESS"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# Ranks of one process sharing a GPU need hardware queues apart (moelink refuses fewer than 8 per rank, up to
# 32): every step gets 32 unless the caller says otherwise.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MOELINK_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt 2>/dev/null)
export MOELINK_CACHE_DIR=/tmp/moelink-jit
summary=$OUT/summary.txt
{ echo "commit $MOELINK_COMMIT, $(date -u +%FT%TZ)"; nvidia-smi -L; } > "$summary"
BUDGET_S=${BUDGET_S:-570}
note() { echo "$*" | tee -a "$summary"; }
run() {  # run NAME LIMIT CMD...: output to $W/NAME.log, status and time to the summary
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
