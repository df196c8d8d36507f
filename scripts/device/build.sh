#!/usr/bin/env bash
# Runs HERE (no GPU needed): builds what the GPU machine runs into the git-ignored .device/ folder.
#
#   .device/moelink          the release binary (bench, selftest, info)
#   .device/moelink-stress   the stress binary (soak, chaos)
#   .device/tests/<crate>.<kind>.<target>   the workspace's test executables, under stable names
#   .device/manifest.txt     commit, build date, toolchain, and every file with its size and sha256
#   .device/base/moelink     with BASE_REV=<rev>: the release binary of that revision, for run.sh's `ab` step
#                            (a worktree of <rev> built in target/base: a full build the first time)
#
# Then one device call carries it: kind nvidia-h200-x4, carry [".device"], command
# `bash scripts/device/run.sh` (see docs/running-on-gpu.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device
rm -rf "$out"
mkdir -p "$out/tests"

cargo build --release -p moelink-cli --bin moelink -p moelink-stress --bin moelink-stress
cp target/release/moelink "$out/moelink"
cp target/release/moelink-stress "$out/moelink-stress"

# Test executables: cargo describes every artifact as one JSON line; keep those of test targets. Left out:
# the two binaries' crates' own tests (they run the binary at the absolute path it had here, which the GPU
# machine lacks), and tests with nothing for a GPU, which would only take carry space: the test kit's (checks
# of the generators), the kernels crate's (NVRTC compiles and the CPU emulator: CI runs them here) and
# moelink's host-only ones (unit tests, validation, fuzzing, host deadlines, topology).
messages=$(mktemp)
trap 'rm -f "$messages"' EXIT
cargo test --workspace --release --no-run --message-format=json >"$messages"
python3 - "$messages" "$out/tests" <<'PY'
import json, os, shutil, sys
messages, dest = sys.argv[1], sys.argv[2]
seen = set()
for line in open(messages):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("profile", {}).get("test") or not m.get("executable"):
        continue
    crate = os.path.basename(os.path.dirname(m["manifest_path"]))
    if crate in ("moelink-cli", "moelink-stress", "moelink-testkit", "moelink-kernels"):
        continue
    t = m["target"]
    name = f"{crate}.{t['kind'][0]}.{t['name']}"
    if name in ("moelink.lib.moelink", "moelink.test.validation", "moelink.test.fuzz_validation", "moelink.test.host_deadline",
                "moelink.test.topology"):
        continue
    if name in seen:
        continue
    seen.add(name)
    shutil.copy2(m["executable"], os.path.join(dest, name))
    print(f"test executable: {name}")
PY

# The candle example's test executable (its own workspace): its CUDA-backend test runs on the GPU machine.
if [ -f examples/candle-moe/Cargo.toml ]; then
    cargo test --release --manifest-path examples/candle-moe/Cargo.toml --no-run --message-format=json >"$messages"
    python3 - "$messages" "$out/tests" <<'PY'
import json, shutil, sys, os
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "ep_matches_dense":
        shutil.copy2(m["executable"], os.path.join(sys.argv[2], "candle-moe.test.ep_matches_dense"))
        print("test executable: candle-moe.test.ep_matches_dense")
PY
fi

# The binary of BASE_REV, for an A/B of the same calls in one device run (run.sh's `ab` step).
if [ -n "${BASE_REV:-}" ]; then
    base_tree=$(mktemp -d)
    git worktree add -q --detach "$base_tree" "$BASE_REV"
    CARGO_TARGET_DIR="$(pwd)/target/base" cargo build --release --manifest-path "$base_tree/Cargo.toml" -p moelink-cli --bin moelink
    mkdir -p "$out/base"
    cp target/base/release/moelink "$out/base/moelink"
    git rev-parse --short "$BASE_REV" >"$out/base/COMMIT"
    git worktree remove --force "$base_tree"
fi

# The Python wheel (abi3, for the GPU machine's Python 3.12), for run.sh's python step.
if [ -f python/pyproject.toml ]; then
    scripts/build-wheel.sh
fi

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit-dirty"
fi
{
    echo "commit: $commit"
    [ -f "$out/base/COMMIT" ] && echo "base: $(cat "$out/base/COMMIT")"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "rustc: $(rustc --version)"
    echo "host: $(uname -srm), $(ldd --version 2>&1 | head -n1)"
    echo "files:"
    (cd "$out" && find . -type f ! -name manifest.txt | sort | while read -r f; do
        printf '  %s  %s bytes  sha256 %s\n' "${f#./}" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"
    done)
} >"$out/manifest.txt"
cat "$out/manifest.txt"

size_mib=$(( $(du -sb "$out" | cut -f1) / 1048576 ))
echo "$out: ${size_mib} MiB (the device call carries at most 64 MiB with the working tree)"
if [ "$size_mib" -gt 48 ]; then
    echo "warning: $out is large; the working tree must still fit in 64 MiB" >&2
fi
