#!/usr/bin/env bash
# Builds the moelink wheel (one abi3 wheel for CPython >= 3.11, no libtorch linked) into .device/ for the
# GPU machine, with .device/COMMIT naming the code it was built from (the device copy has no git).
#
#   scripts/build-wheel.sh
#   # device: carry [".device"], command `bash scripts/device/python.sh`
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${MOELINK_PY_VENV:-.venv-py}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin==1.16.0"

mkdir -p .device
rm -f .device/moelink-*.whl
(cd python && "../$venv/bin/maturin" build --release --quiet -o ../.device)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain -- crates python 2>/dev/null)" ]; then
    commit="$commit-dirty"
fi
echo "$commit" > .device/COMMIT
ls -l .device/moelink-*.whl
echo "commit $commit"
