#!/usr/bin/env bash
# Call 106 (2 x H200, issue 31): the HT combine's block shape at EP2. head = 3ba0732 (12 warps a block, 24
# reducer vectors in flight a lane); c16l16 and c14l18: the same source built with HtCombineVariant::WARPS /
# REDUCE_LOAD_VECS = 16 / 16 and 14 / 18 (experiment builds, not committed). 1. each checked against the host;
# 2. 3 rounds alternating at 24 SMs; 3. 16 and 32 SMs; 4. combine sender split for c16l16; 5. traces.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s106; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
row() { grep -E "^ht " $1 | awk '{printf " %s/%s %s c%s %s |", $2,$3,$4,$8,$9}'; echo; }
for w in head c16l16 c14l18; do
  MOELINK_COMMIT="$(cat .device/COMMIT)-$w" timeout -k 5 90 $(bin $w) bench --mode ht --dtype all --num-sms 24 --reps 5 --json $S/checked-$w.json > $S/checked-$w.log 2>&1
  printf "%-18s rc=%s:" checked-$w $?; row $S/checked-$w.log; done
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT="$(cat .device/COMMIT)-$w" "$@" timeout -k 5 90 $(bin $w) bench --mode ht --dtype bf16 --reps 20 --no-host-check --json $S/ht-$name.json ${ARGS:---num-sms 24} > $S/ht-$name.log 2>&1
  printf "%-22s rc=%s %s:" $name $? "$*"; row $S/ht-$name.log; }
for i in 1 2 3; do for w in head c16l16 c14l18; do ht $w-$i $w; done; done
for n in 16 32; do for w in head c16l16 c14l18; do ARGS="--num-sms $n" ht sms$n-$w $w; done; done
for n in 9 11 12; do ht c16l16-cs$n c16l16 MOELINK_HT_COMBINE_SEND_BLOCKS=$n; done
echo "sweeps done at $(el)"
for w in head c16l16; do
  MOELINK_HT_TRACE=1 MOELINK_COMMIT="$(cat .device/COMMIT)-$w" timeout -k 5 60 $(bin $w) bench --mode ht --dtype bf16 --num-sms 24 --reps 3 --warmup 1 --no-host-check --json $S/trace-$w.json > $S/trace-$w.log 2>&1
  echo "trace $w rc=$?"; grep "combine" $S/trace-$w.log | grep "moelink trace" | cut -c1-330 | tail -2; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call106.tgz s106
