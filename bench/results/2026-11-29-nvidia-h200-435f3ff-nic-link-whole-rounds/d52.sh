#!/usr/bin/env bash
# Call 52 (1 x H200): daabe46 (nvl_bytes_needed as the least size that holds the rounds): ht_internode and
# internode_gpu, and a soak 2x2 over the emulated NIC with small rounds (30 s).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT/s"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=160 OUT=$OUT/t W=/tmp/w52t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
export MOELINK_JIT_CACHE=/tmp/jit52
timeout 120 .device/moelink-stress soak --backend cuda --progress-s 200 --json "$OUT/s/soak-2x2-nic.json" --ranks 4 --topology 2x2 \
  --transport emu-nic:reorder=20,nic-blocks=2 --t-max 512 --ht-round-tokens 96 --time-budget-s 30 > /tmp/s52.log 2>&1; echo "rc=$?"
grep -E "^(ht|ll)|^soak|ERROR|buffers for" /tmp/s52.log | cut -c1-250 | head -9
