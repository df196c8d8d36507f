#!/usr/bin/env bash
# Call 88 (2 x H200, issue 31): the final build 93eabf1 (both HT kernels as 59ff347's) against base d386798.
# 1. moelink.test.ht at 2 ranks; 2. soak of the HT families; 3. A/B, 2 rounds alternating, HT at DeepEP's shapes
# at 8, 16 and 24 SMs; 4. 4 ranks sharing the 2 GPUs (1x4, thread mode), base and head.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s88; mkdir -p $S; H=.device/moelink; Bb=.device/base/moelink
t0=$(date +%s)
cm() { case $1 in base) echo d386798;; *) cat .device/COMMIT;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 OUT=/tmp/o88 W=/tmp/w88 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 30 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 1 $S/soak.log
timeout -k 5 150 $H bench --mode ht --dtype all --num-sms 24 --reps 30 --json $S/head-checked.json > $S/head-checked.log 2>&1
echo "head checked rc=$? at $(el)"; grep -E "^ht " $S/head-checked.log
for i in 1 2; do for w in base head; do b=$H; [ $w = base ] && b=$Bb
  MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $b bench --mode ht --dtype all --num-sms 8,16,24 --reps 30 --no-host-check --json $S/ab-$w-$i.json > $S/ab-$w-$i.log 2>&1
  echo "ab $w $i rc=$?"; grep -E "^ht " $S/ab-$w-$i.log; done; done
for w in base head; do b=$H; [ $w = base ] && b=$Bb
  CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cm $w) timeout -k 5 120 $b bench --mode ht --ranks 4 --topology 1x4 --dtype all --num-sms 24 --reps 10 --json $S/share-$w.json > $S/share-$w.log 2>&1
  echo "1x4 shared $w rc=$? at $(el)"; grep -E "^ht |error" $S/share-$w.log | head -4; done
echo "all done at $(el)"
cp /tmp/o88/*.json $S/ 2>/dev/null
tar -C /tmp -czf $OUT/call88.tgz s88
