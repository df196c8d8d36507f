#!/usr/bin/env bash
# Runs on the device machine: the CUDA layer's GPU tests and the thread-mode diagnostics over every visible
# GPU, from binaries staged by scripts/build-gpu-tests.sh. Logs go to $OUT; a summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export MOELINK_JIT_VERBOSE=1
export MOELINK_CACHE_DIR="${TMPDIR:-/tmp}/moelink-kernel-cache"
OUT="${OUT:-.}"
summary=()
for t in moelink_cuda_gpu moelink_diag_gpu; do
  bin=.device/gpu-tests/$t
  if [[ ! -x $bin ]]; then summary+=("$t: MISSING (run scripts/build-gpu-tests.sh)"); continue; fi
  start=$SECONDS
  timeout 240 "$bin" --include-ignored --test-threads 1 --nocapture >"$OUT/$t.log" 2>&1
  rc=$?
  skipped=$(grep -c 'skipping ' "$OUT/$t.log")
  summary+=("$t: rc=$rc, $skipped skipped ($(grep -E '^test result' "$OUT/$t.log" | tail -n 1)) in $((SECONDS - start)) s")
done
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader >"$OUT/gpus.txt" 2>&1 || true
echo "==== summary"
cat "$OUT/gpus.txt"
grep -hE "skipping |GB/s|barrier:|JIT:|cold|DeadlineOutcome|FAILED|panicked" "$OUT"/moelink_*.log | head -n 60
printf '%s\n' "${summary[@]}"
