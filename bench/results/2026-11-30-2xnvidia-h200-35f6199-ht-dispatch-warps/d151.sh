#!/usr/bin/env bash
# Call 151 (2 x H200, a GPU per rank; issue 31): more warps per HT dispatch block, so that an SM's stores go
# on while some warps wait at their batch fence (call 150: the fence costs ~10 us of the cached FP8
# dispatch). head = 35f6199 (16 warps, up to 16 vectors a lane in flight, 125-128 registers);
# w24u8 = 24 warps, 8 vectors a lane (80 registers); w32u6 = 32 warps, 6 vectors (64 registers). Senders and
# receivers both get the warps. Real runs checked against the host; senders alone unchecked.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s151; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT="$(cat .device/COMMIT)+$w" timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) %s |", $2, $3, $4, $5, $8}'; echo; }
for i in 1 2; do for w in head w24u8 w32u6; do ht real-$w-$i $w; done; done
for w in head w24u8 w32u6; do MOELINK_HT_TIMING_EXPERIMENT=5 ht send-$w $w --no-host-check; done
for n in 8 12; do for w in w24u8 w32u6; do MOELINK_HT_DISPATCH_SEND_BLOCKS=$n ht s$n-$w $w; done; done
for w in head w24u8; do ht sweep-$w $w --tokens 512,2048 --routing uniform,skewed; done
echo "done at $(el)"
tar -C /tmp -czf $OUT/call151.tgz s151
