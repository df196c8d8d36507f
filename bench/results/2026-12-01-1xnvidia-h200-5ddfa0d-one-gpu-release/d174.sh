#!/usr/bin/env bash
# Call 174 (1 x H200): HT soak of head (5ddfa0d's binaries) with every rank on the one GPU, where the HT
# kernels now default to the senders' own fences: 4 ranks for 100 s, then 2 ranks for 60 s; fresh and cached
# dispatch + combine, up to 1024 tokens, every round checked bit for bit against the host backend.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_CACHE_DIR=/tmp/jit174
S=/tmp/s174; mkdir -p $S
for r in 4 2; do
  t=100; [ $r = 2 ] && t=60
  timeout -k 5 $((t + 90)) .device/moelink-stress soak --backend cuda --ranks $r --families ht,ht-cached --t-max 1024 \
    --time-budget-s $t --progress-s 30 --json $S/soak-$r.json > $S/soak-$r.log 2>&1
  echo "soak ranks=$r rc=$?"; tail -6 $S/soak-$r.log
done
tar -C /tmp -czf $OUT/call174.tgz s174
