#!/usr/bin/env bash
# Call 68 (1 x H200): 0f68b5f, a longer HT soak (families ht, ht-cached) across 2x2 over the emulated NIC with
# reordering: the reducers' token-at-a-time counter under random shapes, several rounds per call.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOELINK_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p /tmp/s68
timeout 150 .device/moelink-stress soak --backend cuda --progress-s 300 --json "/tmp/s68/soak-2x2-nic-ht.json" --ranks 4 --topology 2x2 \
  --transport emu-nic:reorder=20,nic-blocks=3 --families ht,ht-cached --t-max 512 --ht-round-tokens 96 --time-budget-s 110 > /tmp/s68a.log 2>&1
echo "soak 2x2 nic ht rc=$?"
grep -E "^(ht)|^soak|ERROR" /tmp/s68a.log | cut -c1-200 | head -6
tar -C /tmp -czf $OUT/call68.tgz s68
