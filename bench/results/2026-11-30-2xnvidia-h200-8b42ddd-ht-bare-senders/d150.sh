#!/usr/bin/env bash
# Call 150 (2 x H200, a GPU per rank; issue 31): the batch fence in the real HT senders over NVLink. Call 149
# put it at +9 / +12 us (BF16 / FP8 cached) in the bare senders. head = 8b42ddd (release batch 4);
# rb6 / rb8 = head with MOELINK_HT_RELEASE_BATCH (fewer fences, coarser chunks); nofence = head +
# nofence.patch (no batch fence in the dispatch and combine senders: timing only, the order is wrong).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s150; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; bin=$2; shift 2
  env MOELINK_COMMIT="$(cat .device/COMMIT)+$name" timeout -k 5 90 $bin bench --mode ht --ranks 2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) %s |", $2, $3, $4, $5, $8}'; echo; }
H=.device/moelink; N=.device/exp/moelink-nofence
for i in 1 2; do
  ht head-$i $H
  MOELINK_HT_RELEASE_BATCH=6 ht rb6-$i $H
  MOELINK_HT_RELEASE_BATCH=8 ht rb8-$i $H
  ht nofence-$i $N --no-host-check
done
MOELINK_HT_TIMING_EXPERIMENT=5 ht send-head $H --no-host-check
MOELINK_HT_TIMING_EXPERIMENT=5 ht send-nofence $N --no-host-check
MOELINK_HT_TIMING_EXPERIMENT=5 MOELINK_HT_RELEASE_BATCH=8 ht send-rb8 $H --no-host-check
echo "done at $(el)"
tar -C /tmp -czf $OUT/call150.tgz s150
