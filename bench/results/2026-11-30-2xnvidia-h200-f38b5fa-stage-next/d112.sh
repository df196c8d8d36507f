#!/usr/bin/env bash
# Call 112 (2 x H200, issue 31): f38b5fa (the HT dispatch senders stage the next batch's first token before the
# fence) against prev = 27567be and base = fa7e461 (whose dispatch is 27567be's too). 1. moelink.test.ht at 2
# ranks; soak; checked bench. 2. A/B 3 rounds at 24 SMs. 3. timing experiment 5 (senders alone). 4. SM counts,
# tokens, skewed, 1x4 (two ranks a GPU), prev and head.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s112; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; base) echo .device/base/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; base) cat .device/base/COMMIT;; prev) echo 27567be;; esac; }
row() { grep -E "^ht " $1 | awk '{printf " %s/%s %s c%s %s |", $2,$3,$4,$8,$9}'; echo; }
STEPS="tests" TEST_BINS="moelink.test.ht" T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o112 W=/tmp/w112 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 50 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 25 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 1 $S/soak.log
timeout -k 5 90 .device/moelink bench --mode ht --dtype all --num-sms 24 --reps 5 --json $S/checked-head.json > $S/checked-head.log 2>&1
printf "%-18s rc=%s:" checked-head $?; row $S/checked-head.log
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) "$@" timeout -k 5 90 $(bin $w) bench --mode ht --dtype ${DT:-all} --reps 20 --no-host-check --json $S/ht-$name.json ${ARGS:---num-sms 24} > $S/ht-$name.log 2>&1
  printf "%-20s rc=%s %s:" $name $? "$*"; row $S/ht-$name.log; }
for i in 1 2 3; do for w in base prev head; do ht $w-$i $w; done; done
for w in prev head; do ht exp5-$w $w MOELINK_HT_TIMING_EXPERIMENT=5; done
echo "ab done at $(el)"
for n in 8 16 32; do for w in prev head; do ARGS="--num-sms $n" ht sms$n-$w $w; done; done
for w in prev head; do ARGS="--num-sms 24 --tokens 512,1024,2048,8192" ht tok-$w $w; grep -E "^ht " $S/ht-tok-$w.log | grep dispatch | awk '{print "   ", $3, $4, $5, $9}' | tr '\n' ' '; echo; done
for w in prev head; do ARGS="--num-sms 24 --routing skewed" ht skew-$w $w; done
for w in prev head; do ARGS="--num-sms 24 --ranks 4 --topology 1x4" CUDA_DEVICE_MAX_CONNECTIONS=32 ht share-$w $w; done
echo "all done at $(el)"
cp /tmp/o112/*.json $S/ 2>/dev/null
tar -C /tmp -czf $OUT/call112.tgz s112
