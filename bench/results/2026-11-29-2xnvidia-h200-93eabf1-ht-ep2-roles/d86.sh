#!/usr/bin/env bash
# Call 86 (2 x H200, issue 31): the final kernels, 5e60697 (dispatch: 59ff347's; combine: ba46e37's, with the
# senders' L2 prefetch) against base d386798. 1. moelink.test.ht at 2 ranks; 2. soak of the HT families;
# 3. A/B, 3 rounds alternating, HT at DeepEP's shapes, 24 SMs; 4. the other shapes, base and head: token sweep,
# skewed routing, SM counts 8/16/48, and 4 ranks sharing the 2 GPUs (1x4, thread mode).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s86; mkdir -p $S; H=.device/moelink; Bb=.device/base/moelink
t0=$(date +%s)
cm() { case $1 in base) echo d386798;; *) cat .device/COMMIT;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 OUT=/tmp/o86 W=/tmp/w86 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 30 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 1 $S/soak.log
timeout -k 5 150 $H bench --mode ht --dtype all --num-sms 24 --reps 30 --json $S/head-checked.json > $S/head-checked.log 2>&1
echo "head checked rc=$? at $(el)"; grep -E "^ht " $S/head-checked.log
for i in 1 2 3; do for w in base head; do b=$H; [ $w = base ] && b=$Bb
  MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $b bench --mode ht --dtype all --num-sms 24 --reps 30 --no-host-check --json $S/ab-$w-$i.json > $S/ab-$w-$i.log 2>&1
  echo "ab $w $i rc=$?"; grep -E "^ht " $S/ab-$w-$i.log; done; done
echo "ab done at $(el)"
for w in base head; do b=$H; [ $w = base ] && b=$Bb
  MOELINK_COMMIT=$(cm $w) timeout -k 5 120 $b bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --tokens 512,1024,2048,8192 --json $S/tok-$w.json > $S/tok-$w.log 2>&1
  echo "tokens $w rc=$? at $(el)"; grep -E "^ht " $S/tok-$w.log
  MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $b bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --routing skewed --json $S/skew-$w.json > $S/skew-$w.log 2>&1
  echo "skewed $w rc=$? at $(el)"; grep -E "^ht " $S/skew-$w.log
  MOELINK_COMMIT=$(cm $w) timeout -k 5 120 $b bench --mode ht --dtype all --num-sms 8,16,48 --reps 20 --no-host-check --json $S/sms-$w.json > $S/sms-$w.log 2>&1
  echo "sms $w rc=$? at $(el)"; grep -E "^ht " $S/sms-$w.log
  CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cm $w) timeout -k 5 120 $b bench --mode ht --ranks 4 --topology 1x4 --dtype all --num-sms 24 --reps 10 --json $S/share-$w.json > $S/share-$w.log 2>&1
  echo "1x4 shared $w rc=$? at $(el)"; grep -E "^ht |error" $S/share-$w.log | head -4; done
echo "all done at $(el)"
cp /tmp/o86/*.json $S/ 2>/dev/null
tar -C /tmp -czf $OUT/call86.tgz s86
