#!/usr/bin/env bash
# The test command (README): every test of the workspace, with NVRTC present so that the JIT compiles
# kernels here too (no GPU needed for that). GPU tests are ignored here (`cargo test` lists them as ignored);
# on a GPU machine `cargo test -- --include-ignored` runs them, with MOELINK_TEST_RANKS ranks.
#
#   scripts/test.sh                 # all tests: the Rust workspace, then the Python package
#   scripts/test.sh -p moelink tcp  # extra arguments go to `cargo test` (the Python tests are skipped)
set -euo pipefail
cd "$(dirname "$0")/.."

# NVRTC 13.0.88 from PyPI (the version the GPU machine's driver accepts CUBINs from) and cuobjdump for the
# SASS checks: ci-nvrtc-env.sh installs them once and prints the export line that makes them visible (it
# prints, it does not export: sourced instead, it leaves the compile check skipping itself).
eval "$(scripts/ci-nvrtc-env.sh)"
export MOELINK_REQUIRE_NVRTC=1
# ... and the nvshmem transport's kernels link against NVSHMEM's device library (ci-nvrtc-env.sh installs it).
export MOELINK_REQUIRE_NVSHMEM=1
# The CPU emulations of the kernels need g++: here a missing compiler is a failure, not a skip.
export MOELINK_REQUIRE_EMU=1

# The device steps (scripts/device/run.sh, run on the GPU machine) are checked here as far as they can be: a
# dry run resolves every step to its body and each body's default sub-steps, with no GPU and no .device/.
if [ $# -eq 0 ]; then
    device_dry=$(mktemp -d)
    if ! DRY_RUN=1 OUT="$device_dry/out" W="$device_dry/work" \
        STEPS="info tests selftest process nvlink bench ab procbench internode python reliability" \
        bash scripts/device/run.sh >"$device_dry/log" 2>&1; then
        cat "$device_dry/log" >&2
        echo "error: the dry run of scripts/device/run.sh failed (its log above)" >&2
        exit 1
    fi
    rm -rf "$device_dry"
fi

# Release profile: on 2 cores it compiles about as fast as the test profile (opt-level 2 + debug info,
# whose link step is slower) and runs the host backend at full speed.
cargo test --workspace --release "$@"

# The Python package: builds the abi3 wheel into a venv and runs python/tests (no torch, no GPU needed).
if [ $# -eq 0 ]; then
    scripts/test-python.sh
fi

# The candle example (examples/candle-moe, its own workspace so that candle stays out of the one above):
# its MoE layer over moelink's host backend at 2 and 4 thread ranks against the dense layer. Its own target
# directory; the first build of candle takes a few minutes on two cores, later runs reuse it.
if [ $# -eq 0 ]; then
    CARGO_TARGET_DIR=target/candle-moe cargo test --release --manifest-path examples/candle-moe/Cargo.toml
fi
