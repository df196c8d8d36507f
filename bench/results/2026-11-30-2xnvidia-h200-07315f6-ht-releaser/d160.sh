#!/usr/bin/env bash
# Call 160 (2 x H200, a GPU per rank; issue 31): the BF16 dispatch with its releaser (receiver-bound) with 9 and
# 8 sender blocks of 24 (MOELINK_HT_DISPATCH_SEND_BLOCKS), i.e. 15 and 16 receiver blocks, against the default
# 10. Build 1ee3baa. Every run checked against the host; only the BF16 rows are read.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s160; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; n=$2; shift 2
  env MOELINK_HT_DISPATCH_SEND_BLOCKS=$n timeout -k 5 120 .device/moelink bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht .*dispatch" $S/$name.log | awk '{printf " %s %s/%s |", (NF==11 ? $4"-"$5 : ""), $(NF-5), $(NF-1)}'; echo; }
for i in 1 2; do for n in 10 9 8; do ht real-s$n-$i $n --ranks 2 --dtype bf16; done; done
echo "bench done at $(el)"
for n in 10 9 8; do ht sweep-s$n $n --ranks 2 --dtype bf16 --tokens 512,1024,2048 --routing uniform,skewed; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call160.tgz s160
