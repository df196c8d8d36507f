#!/usr/bin/env bash
# Call 137 (1 x H200: the two ranks of EP2 share the GPU, so no figure here is an NVLink one; issue 31),
# head = 2dc69d6 (kernels of 9515bc6), roll = head + the HT dispatch senders' staged (FP8) payload rolling:
# each vector's load of the batch's next token follows its store of the current one. Cached and fresh
# dispatch, combine at 24 SMs, real and senders alone (MOELINK_HT_TIMING_EXPERIMENT=5), alternating builds.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s137; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo "$(cat .device/COMMIT)+$1";; esac; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --topology 1x2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s |", $2, $3, $4, $8}'; echo; }
for i in 1 2; do for w in head roll; do ht real-$w-$i $w; done; done
for i in 1 2; do for w in head roll; do MOELINK_HT_TIMING_EXPERIMENT=5 ht send-$w-$i $w --no-host-check; done; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call137.tgz s137
