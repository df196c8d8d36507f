#!/usr/bin/env bash
# The Python package's CI tests, from a clean clone, without a GPU: builds the abi3 wheel with maturin,
# installs it into a venv without torch and runs python/tests (the native module on the host backend with numpy
# arrays and thread ranks, and the API surface by inspection; the tests that need torch skip there), then the
# torch layer on the host backend in a second venv with torch (below). A few minutes on 2 cores, plus torch's
# download the first time.
#
#   scripts/test-python.sh            # build + test
#   scripts/test-python.sh -k ll      # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${MOELINK_PY_VENV:-.venv-py}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# Pinned tools; numpy/pytest only for the tests (the wheel itself depends on nothing).
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin==1.16.0" "numpy>=1.24" "pytest>=7"
wheels=target/python-wheels
rm -rf "$wheels"
# Release build: shares target/release with `cargo test --release` (scripts/test.sh), so the core is compiled once.
(cd python && "../$venv/bin/maturin" build --release --quiet -o "../$wheels")
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheels"/moelink-*.whl

# Run from outside the source tree so that `import moelink` is the installed wheel, not python/moelink.
(cd python/tests && "../../$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" .)
[ $# -eq 0 ] || exit 0

# The torch layer (moelink.Buffer) on the host backend, in a venv of its own with torch (the one above stays
# without it, as users without torch have it): python/tests/gpu as 2 ranks over gloo, which includes the fast
# path's checks against the event path, and the host-cost bench in quick mode (test_bench.py). Its figures are
# CPU work, not GPU figures. MOELINK_SKIP_TORCH=1 leaves this out.
if [ "${MOELINK_SKIP_TORCH:-0}" = 1 ]; then
    echo "MOELINK_SKIP_TORCH=1: the torch layer's host tests are skipped"
    exit 0
fi
tvenv=${MOELINK_TORCH_VENV:-.venv-torch}
if [ ! -x "$tvenv/bin/python" ]; then
    python3 -m venv "$tvenv"
fi
# torch's CPU build where its index is reachable (a fraction of the download), else PyPI's: CUDA builds with
# NVIDIA's libraries, about 5.5 GB installed and 3.5 GB downloaded on top. Where neither fits, the torch layer's
# host tests are skipped, loudly: they also run on the GPU machine (scripts/device/run.sh, STEPS=python PY_STEPS=ci).
skip_torch() {
    echo "SKIPPED: the torch layer's host tests (python/tests/gpu, test_bench.py, ...): $1" >&2
    rm -rf "$tvenv"
    exit 0
}
if ! "$tvenv/bin/python" -c "import torch" 2>/dev/null; then
    pip_q=("$tvenv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
    if ! "${pip_q[@]}" --retries 0 --timeout 20 torch --index-url https://download.pytorch.org/whl/cpu 2>/dev/null; then
        free_gb=$(df -Pk "$tvenv" | awk 'NR == 2 { print int($4 / 1048576) }')
        if [ "$free_gb" -lt 12 ]; then
            skip_torch "torch's CPU index is unreachable and PyPI's torch needs about 12 GB free while installing; $free_gb GB are free"
        fi
        "${pip_q[@]}" torch || skip_torch "pip could not install torch from PyPI (see its error above)"
    fi
fi
"$tvenv/bin/python" -m pip install -q --disable-pip-version-check "numpy>=1.24" "pytest>=7"
"$tvenv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheels"/moelink-*.whl
(cd python/tests && OMP_NUM_THREADS=1 "../../$tvenv/bin/python" -m pytest -q -p no:cacheprovider test_bench.py test_api.py test_stall_gloo.py test_torch_args.py test_tensor_read.py)
MOELINK_BACKEND=host OMP_NUM_THREADS=1 "$tvenv/bin/torchrun" --standalone --nproc_per_node=2 --local-ranks-filter 0 \
    -m pytest -q -p no:cacheprovider python/tests/gpu
