#!/usr/bin/env bash
# Call 136 (1 x H200: the two ranks of EP2 share the GPU, no NVLink figure; issue 31), head = 2dc69d6.
# The HT dispatch senders alone (MOELINK_HT_TIMING_EXPERIMENT=5) reach ~28 GB/s an SM for FP8 on one GPU
# as over NVLink (call 135): what sets it? Release batch 4/8/16/32 and sender blocks 10/16/20 (24 SMs),
# and exp 7 (no remote payload either: the per-token cost without the payload).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s136; mkdir -p $S
t0=$(date +%s)
ht() { name=$1; shift
  env "$@" timeout -k 5 90 .device/moelink bench --mode ht --ranks 2 --topology 1x2 --reps 20 --no-host-check --json $S/$name.json > $S/$name.log 2>&1; rc=$?
  printf "%-14s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s |", $2, $3, $4, $8}'; echo; }
for rb in 4 8 16 32; do ht s-rb$rb MOELINK_HT_TIMING_EXPERIMENT=5 MOELINK_HT_RELEASE_BATCH=$rb; done
for sb in 16 20; do ht s-sb$sb MOELINK_HT_TIMING_EXPERIMENT=5 MOELINK_HT_DISPATCH_SEND_BLOCKS=$sb MOELINK_HT_COMBINE_SEND_BLOCKS=$sb; done
ht s-nopayload MOELINK_HT_TIMING_EXPERIMENT=7
ht s-nopayload-rb16 MOELINK_HT_TIMING_EXPERIMENT=7 MOELINK_HT_RELEASE_BATCH=16
ht real-rb8 MOELINK_HT_RELEASE_BATCH=8
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call136.tgz s136
