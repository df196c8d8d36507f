#!/usr/bin/env bash
# Installs NVRTC 13.0.88 (what the GPU box runs) plus cuobjdump/nvdisasm (for the SASS checks) from PyPI
# into a virtual environment, once, and prints the line that makes them visible to the kernel compile check
# (crates/moelink-kernels/tests/compile_all.rs). The internode kernels of the `nvshmem` transport compile
# against NVSHMEM 3.4.5 (what torch 2.11 pins) and the CUDA runtime / libcu++ headers, and link with
# nvJitLink: those wheels come too, and the line sets NVSHMEM_HOME and MOELINK_TEST_CUDA_HOME to them. Idempotent: a
# second run only prints the line.
#
#   eval "$(scripts/ci-nvrtc-env.sh)"
#   MOELINK_REQUIRE_NVRTC=1 cargo test -p moelink-kernels --test compile_all
#
# The venv lives at $MOELINK_NVRTC_VENV (default: ~/.cache/moelink/nvrtc-venv). Progress goes to stderr;
# stdout is only the export line.
set -euo pipefail

VENV="${MOELINK_NVRTC_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/moelink/nvrtc-venv}"
PACKAGES=("nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-cuobjdump==13.2.86" "nvidia-cuda-nvdisasm==13.2.86"
  "nvidia-nvshmem-cu13==3.4.5" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-nvjitlink==13.0.88")

find_cu13() { ls -d "$VENV"/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -n 1; }

CU13="$(find_cu13 || true)"
if [[ -z "$CU13" || ! -e "$CU13/lib/libnvrtc.so.13" || ! -x "$CU13/bin/cuobjdump" || ! -x "$CU13/bin/nvdisasm" \
      || ! -e "$CU13/lib/libnvJitLink.so.13" || ! -e "$CU13/include/cuda_runtime.h" || ! -e "$CU13/../nvshmem/lib/libnvshmem_device.a" ]]; then
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV" >&2
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" >&2
  fi
  echo "installing ${PACKAGES[*]} into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PACKAGES[@]}" >&2
  CU13="$(find_cu13)"
fi

NVSHMEM="$(cd "$CU13/../nvshmem" && pwd)"
for f in "$CU13/lib/libnvrtc.so.13" "$CU13/lib/libnvrtc-builtins.so.13.0" "$CU13/bin/cuobjdump" "$CU13/bin/nvdisasm" \
         "$CU13/lib/libnvJitLink.so.13" "$CU13/include/cuda_runtime.h" "$NVSHMEM/lib/libnvshmem_device.a" "$NVSHMEM/include/nvshmem.h"; do
  [[ -e "$f" ]] || { echo "ci-nvrtc-env: $f is missing after the install" >&2; exit 1; }
done

# The CUDA headers' folder goes out as MOELINK_TEST_CUDA_HOME, not CUDA_HOME: cudarc's build script reruns
# when CUDA_HOME changes (cargo:rerun-if-env-changed), so exporting it to `cargo test` would make the next
# plain `cargo run` rebuild cudarc and everything above it.
echo "export LD_LIBRARY_PATH=\"$CU13/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\" PATH=\"$CU13/bin:\$PATH\" MOELINK_CUOBJDUMP=\"$CU13/bin/cuobjdump\" NVSHMEM_HOME=\"$NVSHMEM\" MOELINK_TEST_CUDA_HOME=\"$CU13\""
