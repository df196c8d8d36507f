#!/usr/bin/env bash
# Call 104 (2 x H200, issue 31): the HT dispatch with own rows by the senders and tapered sender chunks
# (2c79509; both off by default, set here by environment) against base fa7e461 (same intranode kernels as 019ae9b).
# 1. moelink.test.ht at 2 ranks, default and own+taper; 2. soak own+taper; 3. checked bench own+taper;
# 4. two rounds of a sweep (base, head default, tapers, own at 10..16 senders, own+taper); 5. trace.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s104; mkdir -p $S; H=.device/moelink; Bb=.device/base/moelink
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o104a W=/tmp/w104a \
  bash scripts/device/run.sh > $S/tests-default.log 2>&1
echo "tests default rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests-default.log | head -5
MOELINK_HT_SENDERS_COPY_OWN=1 MOELINK_HT_SEND_TAPER=160 STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o104b W=/tmp/w104b \
  bash scripts/device/run.sh > $S/tests-own.log 2>&1
echo "tests own rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests-own.log | head -5
MOELINK_HT_SENDERS_COPY_OWN=1 MOELINK_HT_SEND_TAPER=160 timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 30 \
  --json $S/soak-own.json > $S/soak-own.log 2>&1
echo "soak own rc=$? at $(el)"; tail -n 4 $S/soak-own.log
MOELINK_HT_SENDERS_COPY_OWN=1 MOELINK_HT_SEND_TAPER=160 MOELINK_HT_DISPATCH_SEND_BLOCKS=12 timeout -k 5 90 $H bench --mode ht --dtype all --num-sms 24 --reps 10 --json $S/own-checked.json > $S/own-checked.log 2>&1
echo "own checked rc=$? at $(el)"; grep -E "^ht " $S/own-checked.log
ht() { name=$1; b=$2; shift 2; env "$@" timeout -k 5 60 $b bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --json $S/ht-$name.json > $S/ht-$name.log 2>&1
  echo "== $name rc=$? at $(el): $*"; grep -E "^ht " $S/ht-$name.log | awk '{print "   ", $2, $3, $4, $9}'; }
for i in 1 2; do
  ht base-$i $Bb
  ht head-$i $H
  ht taper80-$i $H MOELINK_HT_SEND_TAPER=80
  ht taper160-$i $H MOELINK_HT_SEND_TAPER=160
  ht taper320-$i $H MOELINK_HT_SEND_TAPER=320
  for n in 10 12 14 16; do ht own$n-$i $H MOELINK_HT_SENDERS_COPY_OWN=1 MOELINK_HT_DISPATCH_SEND_BLOCKS=$n; done
  for n in 12 14; do ht own$n-taper-$i $H MOELINK_HT_SENDERS_COPY_OWN=1 MOELINK_HT_DISPATCH_SEND_BLOCKS=$n MOELINK_HT_SEND_TAPER=160; done
done
MOELINK_HT_TRACE=1 MOELINK_HT_SENDERS_COPY_OWN=1 MOELINK_HT_DISPATCH_SEND_BLOCKS=12 MOELINK_HT_SEND_TAPER=160 timeout -k 5 60 $H bench --mode ht --dtype all --num-sms 24 --reps 3 --warmup 1 --no-host-check --json $S/trace.json > $S/trace.log 2>&1
echo "trace rc=$? at $(el)"; grep "cached dispatch" $S/trace.log | cut -c1-330 | tail -4
echo "all done at $(el)"
cp /tmp/o104a/*.json /tmp/o104b/*.json $S/ 2>/dev/null
tar -C /tmp -czf $OUT/call104.tgz s104
