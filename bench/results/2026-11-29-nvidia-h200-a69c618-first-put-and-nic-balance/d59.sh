#!/usr/bin/env bash
# Call 59 (1 x H200: ranks share the GPU): 94191ab (expert_tokens' parts at fixed offsets). ht_internode (calls
# with 2, then 4 experts per rank), internode_gpu; the 2x2 emu-nic soak that draws the expert count each round
# (it found the leftover copy at 33edf39); a 2x1 ptr soak.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p /tmp/s59
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=160 OUT=/tmp/t59 W=/tmp/w59t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
cp /tmp/t59/summary.md /tmp/s59/tests-summary.md 2>/dev/null
export MOELINK_COMMIT=$HEAD_COMMIT
timeout 60 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s59/soak-2x2-nic.json" --ranks 4 --topology 2x2 \
  --transport emu-nic:reorder=20,nic-blocks=3 --t-max 512 --ht-round-tokens 96 --time-budget-s 35 > /tmp/s59a.log 2>&1; echo "soak 2x2 nic rc=$?"
grep -E "^(ht|ll)|^soak|ERROR" /tmp/s59a.log | cut -c1-200 | head -8
timeout 40 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s59/soak-2x1-ptr.json" --ranks 2 --topology 2x1 \
  --transport ptr --t-max 1024 --ht-round-tokens 128 --time-budget-s 20 > /tmp/s59b.log 2>&1; echo "soak 2x1 ptr rc=$?"
grep -E "^soak|ERROR" /tmp/s59b.log | cut -c1-200
tar -C /tmp -czf $OUT/call59.tgz s59
