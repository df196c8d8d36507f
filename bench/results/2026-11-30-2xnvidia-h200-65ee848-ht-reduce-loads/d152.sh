#!/usr/bin/env bash
# Call 152 (2 x H200, a GPU per rank; issue 31): the HT combine reducers' loads in flight per lane
# (MOELINK_HT_REDUCE_LOAD_VECS; default 24 = 3 rounds of 10 vectors a rank at EP2; 32 = 2 rounds of 14;
# 16 = 4 rounds). head = 65ee848. Real runs checked bit for bit against the host, alternated.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s152; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; l=$2; shift 2
  env MOELINK_COMMIT="$(cat .device/COMMIT)+l$l" MOELINK_HT_REDUCE_LOAD_VECS=$l timeout -k 5 90 .device/moelink bench --mode ht --ranks 2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s (%s) |", $2, $3, $4, $5, $6}'; echo; }
for i in 1 2 3; do for l in 24 32 16; do ht l$l-$i $l; done; done
for l in 24 32; do ht sweep-l$l $l --tokens 512,2048 --routing uniform,skewed; done
echo "done at $(el)"
tar -C /tmp -czf $OUT/call152.tgz s152
