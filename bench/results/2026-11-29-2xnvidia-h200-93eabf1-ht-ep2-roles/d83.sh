#!/usr/bin/env bash
# Call 83 (2 x H200, issue 31): head (HT senders take their next chunk at the last fence; dispatch receivers load
# the meta words with the payload, poll a single due row with the acquire) against base d386798.
# 1. moelink.test.ht at 2 ranks; 2. soak of the HT families (T <= 1024); 3. A/B, 3 rounds alternating, HT at
# DeepEP's shapes, 24 SMs; 4. head trace; 5. head timing experiments 5/6/7; 6. head sender split sweep;
# 7. token sweep and skewed routing, base and head.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s83; mkdir -p $S; H=.device/moelink; Bb=.device/base/moelink
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 OUT=/tmp/o83 W=/tmp/w83 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|ignored|passed" $S/tests.log | head -8
timeout -k 5 80 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 50 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 6 $S/soak.log
timeout -k 5 150 $H bench --mode ht --dtype all --num-sms 24 --reps 30 --json $S/head-checked.json > $S/head-checked.log 2>&1
echo "head checked rc=$? at $(el)"; grep -E "^ht " $S/head-checked.log
for i in 1 2 3; do for w in base head; do b=$H; [ $w = base ] && b=$Bb
  timeout -k 5 90 $b bench --mode ht --dtype all --num-sms 24 --reps 30 --no-host-check --json $S/ab-$w-$i.json > $S/ab-$w-$i.log 2>&1
  echo "ab $w $i rc=$?"; grep -E "^ht " $S/ab-$w-$i.log; done; done
echo "ab done at $(el)"
MOELINK_HT_TRACE=1 timeout -k 5 90 $H bench --mode ht --dtype all --num-sms 24 --reps 3 --warmup 1 --no-host-check --json $S/trace.json > $S/trace.log 2>&1
echo "trace rc=$?"; grep "moelink trace: rank 0" $S/trace.log | grep -v "span 2[0-9][0-9]\.\|span 3" | cut -c1-330 | tail -6
ht() { name=$1; shift; env "$@" timeout -k 5 90 $H bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --json $S/ht-$name.json > $S/ht-$name.log 2>&1
  echo "== $name rc=$? at $(el): $*"; grep -E "^ht " $S/ht-$name.log; }
ht exp5 MOELINK_HT_TIMING_EXPERIMENT=5
ht exp6 MOELINK_HT_TIMING_EXPERIMENT=6
ht exp7 MOELINK_HT_TIMING_EXPERIMENT=7
ht ds8 MOELINK_HT_DISPATCH_SEND_BLOCKS=8 MOELINK_HT_COMBINE_SEND_BLOCKS=8
ht ds12 MOELINK_HT_DISPATCH_SEND_BLOCKS=12 MOELINK_HT_COMBINE_SEND_BLOCKS=12
ht ds14 MOELINK_HT_DISPATCH_SEND_BLOCKS=14 MOELINK_HT_COMBINE_SEND_BLOCKS=14
for w in base head; do b=$H; [ $w = base ] && b=$Bb
  timeout -k 5 120 $b bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --tokens 512,1024,2048,8192 --json $S/tok-$w.json > $S/tok-$w.log 2>&1
  echo "tokens $w rc=$? at $(el)"; grep -E "^ht " $S/tok-$w.log
  timeout -k 5 90 $b bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --routing skewed --json $S/skew-$w.json > $S/skew-$w.log 2>&1
  echo "skewed $w rc=$? at $(el)"; grep -E "^ht " $S/skew-$w.log; done
echo "all done at $(el)"
cp /tmp/o83/*.json $S/ 2>/dev/null
tar -C /tmp -czf $OUT/call83.tgz s83
