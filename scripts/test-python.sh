#!/usr/bin/env bash
# The Python package's CI tests, from a clean clone, without a GPU or torch: builds the abi3 wheel with
# maturin, installs it into a venv and runs python/tests (the native module on the host backend with numpy
# arrays and thread ranks, and the API surface by inspection). A few minutes on 2 cores. With torch in the
# venv (MOELINK_TEST_TORCH=1) also the tests on real gloo processes.
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
# The tests that need torch (real gloo processes on the host backend: test_stall_gloo.py, test_torch_args.py)
# skip themselves without it. MOELINK_TEST_TORCH=1 installs it into the venv first: torch's CPU build where
# its index is reachable, else PyPI's (about 2.7 GB with its CUDA libraries, a few minutes).
if [ "${MOELINK_TEST_TORCH:-0}" = 1 ] && ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check torch --index-url https://download.pytorch.org/whl/cpu \
        || "$venv/bin/python" -m pip install -q --disable-pip-version-check torch
fi

wheels=target/python-wheels
rm -rf "$wheels"
# Release build: shares target/release with `cargo test --release` (scripts/test.sh), so the core is compiled once.
(cd python && "../$venv/bin/maturin" build --release --quiet -o "../$wheels")
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheels"/moelink-*.whl

# Run from outside the source tree so that `import moelink` is the installed wheel, not python/moelink.
cd python/tests
exec "../../$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" .
