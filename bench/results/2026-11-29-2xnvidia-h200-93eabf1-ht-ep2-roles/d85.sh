#!/usr/bin/env bash
# Call 85 (2 x H200, issue 31): head ba46e37 (59ff347's chunk grab and receiver meta loads; the senders' L2 bulk
# prefetch of their next chunk's rows) against mid 59ff347 and base d386798. 1. moelink.test.ht at 2 ranks;
# 2. soak of the HT families; 3. A/B/C, 3 rounds alternating, HT at DeepEP's shapes, 24 SMs; 4. head timing
# experiments 5/6/7 and trace; 5. token sweep and skewed routing, head; 6. the Python API beside DeepEP (host
# cost, DeepEP's own tests against both, the GPU suite) with the head wheel.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s85; mkdir -p $S; H=.device/moelink; M=.device/mid/moelink; Bb=.device/base/moelink
t0=$(date +%s)
cm() { case $1 in base) echo d386798;; mid) echo 59ff347;; *) cat .device/COMMIT;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 OUT=/tmp/o85 W=/tmp/w85 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 30 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 1 $S/soak.log
timeout -k 5 150 $H bench --mode ht --dtype all --num-sms 24 --reps 30 --json $S/head-checked.json > $S/head-checked.log 2>&1
echo "head checked rc=$? at $(el)"; grep -E "^ht " $S/head-checked.log
for i in 1 2 3; do for w in base mid head; do b=$H; [ $w = base ] && b=$Bb; [ $w = mid ] && b=$M
  MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $b bench --mode ht --dtype all --num-sms 24 --reps 30 --no-host-check --json $S/ab-$w-$i.json > $S/ab-$w-$i.log 2>&1
  echo "ab $w $i rc=$?"; grep -E "^ht " $S/ab-$w-$i.log; done; done
echo "ab done at $(el)"
ht() { name=$1; shift; env "$@" timeout -k 5 90 $H bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --json $S/ht-$name.json > $S/ht-$name.log 2>&1
  echo "== $name rc=$? at $(el): $*"; grep -E "^ht " $S/ht-$name.log; }
ht exp5 MOELINK_HT_TIMING_EXPERIMENT=5
ht exp6 MOELINK_HT_TIMING_EXPERIMENT=6
ht exp7 MOELINK_HT_TIMING_EXPERIMENT=7
MOELINK_HT_TRACE=1 timeout -k 5 90 $H bench --mode ht --dtype all --num-sms 24 --reps 3 --warmup 1 --no-host-check --json $S/trace.json > $S/trace.log 2>&1
echo "trace rc=$?"
timeout -k 5 120 $H bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --tokens 512,1024,2048,8192 --json $S/tok-head.json > $S/tok-head.log 2>&1
echo "tokens head rc=$? at $(el)"; grep -E "^ht " $S/tok-head.log
timeout -k 5 90 $H bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --routing skewed --json $S/skew-head.json > $S/skew-head.log 2>&1
echo "skewed head rc=$? at $(el)"; grep -E "^ht " $S/skew-head.log
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=280 BUDGET_S=290 \
  OUT=/tmp/o85p W=/tmp/w85p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A14 "moelink / DeepEP\|== summary" $S/python.log | head -40
cp -r /tmp/w85p/python/. $S/ 2>/dev/null; cp /tmp/o85p/* $S/ 2>/dev/null; cp /tmp/o85/*.json $S/ 2>/dev/null
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call85.tgz s85
