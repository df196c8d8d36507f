#!/usr/bin/env bash
# Builds the GPU test binaries of the CUDA layer and the diagnostics here (no GPU needed) and stages them in
# .device/gpu-tests/ for the device machine (run: carry [".device"], command `bash scripts/device/gpu-tests.sh`).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device/gpu-tests
mkdir -p "$out"
cargo test --no-run --message-format=json -p moelink-cuda --test gpu -p moelink --test diag_gpu 2>/dev/null |
  python3 -c '
import json, shutil, sys
names = {"gpu": "moelink_cuda_gpu", "diag_gpu": "moelink_diag_gpu"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in names:
        dst = sys.argv[1] + "/" + names[m["target"]["name"]]
        shutil.copy2(m["executable"], dst)
        print("staged", dst)
' "$out"
strip "$out"/moelink_cuda_gpu "$out"/moelink_diag_gpu   # 28 MB -> 1.3 MB each: carried paths share 64 MiB
