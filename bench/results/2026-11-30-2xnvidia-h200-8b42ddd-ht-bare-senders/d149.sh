#!/usr/bin/env bash
# Call 149 (2 x H200, a GPU per rank; issue 31): what limits the HT dispatch senders (~27-31 GB/s an SM
# where bench nvlink's copy kernel moves ~44)? head = 8b42ddd; bare = head + bare-senders.patch (timing
# experiment 16: each sender warp copies token t's payload to slab row [me][t], no prefix, meta words,
# checks or fence; 32 adds the fence per batch). All with no copy-out and no expert checks (bits 1 and 4),
# unchecked (the results are wrong): senders alone, at 10 sender blocks and a sweep of 6/8/12/14.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s149; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; bin=$2; x=$3; shift 3
  env MOELINK_COMMIT="$(cat .device/COMMIT)+$name" MOELINK_HT_TIMING_EXPERIMENT=$x timeout -k 5 90 $bin bench --mode ht --ranks 2 --reps 20 --no-host-check --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) %s |", $2, $3, $4, $5, $8}'; echo; }
for i in 1 2; do
  ht send5-$i .device/moelink 5
  ht bare21-$i .device/exp/moelink-bare 21
  ht bare53-$i .device/exp/moelink-bare 53
done
for n in 6 8 12 14; do MOELINK_HT_DISPATCH_SEND_BLOCKS=$n ht bare21-s$n .device/exp/moelink-bare 21; MOELINK_HT_DISPATCH_SEND_BLOCKS=$n ht send5-s$n .device/moelink 5; done
echo "done at $(el)"
timeout -k 5 60 .device/moelink bench nvlink --no-jit --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -E "pair sm-stores" $S/nvlink.log
tar -C /tmp -czf $OUT/call149.tgz s149
