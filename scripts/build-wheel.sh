#!/usr/bin/env bash
# Builds the moelink wheel (one abi3 wheel for CPython >= 3.11, no libtorch linked) into .device/ for the
# GPU machine, with .device/COMMIT naming the code it was built from (the device copy has no git).
#
# The wheel is tagged manylinux_2_28 (glibc >= 2.28: RHEL/Rocky/Alma 8, Ubuntu 20.04, Debian 10 and newer),
# without a manylinux container: `maturin build --zig` links against zig's glibc 2.28 stubs, and
# `auditwheel show` then checks that no symbol needs a newer glibc (the script fails if one does).
#
#   scripts/build-wheel.sh
#   # device: carry [".device"], command `STEPS=python bash scripts/device/run.sh`
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${MOELINK_PY_VENV:-.venv-py}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# Absolute: the zig linker wrapper runs `python -m ziglang` from cargo's working directories.
venv=$(cd "$venv" && pwd)
"$venv/bin/python" -m pip install -q --disable-pip-version-check "maturin==1.16.0" "ziglang==0.13.0" "auditwheel==6.1.0"

mkdir -p .device
rm -f .device/moelink-*.whl
# maturin finds zig as `python -m ziglang` of the python on PATH: the venv's.
(cd python && PATH="$venv/bin:$PATH" "$venv/bin/maturin" build --release --quiet --zig --compatibility manylinux_2_28 -o ../.device)
wheel=$(ls .device/moelink-*.whl)
report=$("$venv/bin/auditwheel" show "$wheel")
if ! grep -q 'consistent with[[:space:]]*the following platform tag: "manylinux_2_28_x86_64"' <<< "$(tr '\n' ' ' <<< "$report")"; then
    echo "$report" >&2
    echo "error: $wheel is not a manylinux_2_28 wheel (auditwheel show above)" >&2
    exit 1
fi
echo "auditwheel: $(basename "$wheel") is consistent with manylinux_2_28_x86_64"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain -- crates python 2>/dev/null)" ]; then
    commit="$commit-dirty"
fi
echo "$commit" > .device/COMMIT
ls -l .device/moelink-*.whl
echo "commit $commit"
