#!/usr/bin/env bash
# Call 138 (1 x H200: the two ranks of EP2 share the GPU, so no figure here is an NVLink one; issue 31),
# head = 2dc69d6 (kernels of 9515bc6); what the HT dispatch senders' fence costs: fgpu = the batch fence at
# GPU scope (correct here, both ranks on one GPU), nofence = no fence (timing only: rows may be read early).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s138; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo "$(cat .device/COMMIT)+$1";; esac; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --topology 1x2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s |", $2, $3, $4, $8}'; echo; }
for i in 1 2; do for w in head fgpu nofence; do ht real-$w-$i $w --no-host-check; done; done
for i in 1 2; do for w in head fgpu nofence; do MOELINK_HT_TIMING_EXPERIMENT=5 ht send-$w-$i $w --no-host-check; done; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call138.tgz s138
