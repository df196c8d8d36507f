#!/usr/bin/env bash
# Call 158 (2 x H200, a GPU per rank; issue 31): the FP8 dispatch with the releaser given its lost sender warp
# back as an 11th sender block (MOELINK_HT_DISPATCH_SEND_BLOCKS=11, 13 receiver blocks), batches of 3 and 4,
# against the defaults (own fences, batches of 4, 10 sender blocks) and the defaults with 11 sender blocks.
# Build 1ee3baa. Every configuration's runs are checked against the host; only the FP8 rows are read
# (the overrides set every kernel of a run).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s158; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; cfg=$2; shift 2
  case $cfg in
    head) envs="";;
    s11) envs="MOELINK_HT_DISPATCH_SEND_BLOCKS=11";;
    r1b3s11) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=3 MOELINK_HT_DISPATCH_SEND_BLOCKS=11";;
    r1b4s11) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=4 MOELINK_HT_DISPATCH_SEND_BLOCKS=11";;
  esac
  env $envs timeout -k 5 120 .device/moelink bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht .*fp8" $S/$name.log | awk '{printf " %s %s %s %s/%s |", $2, $3, (NF==11 ? $4"-"$5 : ""), $(NF-5), $(NF-1)}'; echo; }
for i in 1 2; do for c in head s11 r1b3s11 r1b4s11; do ht real-$c-$i $c --ranks 2 --dtype fp8; done; done
echo "bench done at $(el)"
for c in head s11 r1b3s11 r1b4s11; do ht sweep-$c $c --ranks 2 --dtype fp8 --tokens 512,1024,2048 --routing uniform,skewed; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call158.tgz s158
