#!/usr/bin/env bash
# Call 105 (2 x H200, issue 31): 3c34b4c (HT dispatch taper on by default: two tokens per sender warp) against
# base fa7e461 (intranode kernels of 019ae9b). 1. moelink.test.ht at 2 ranks; soak; checked bench. 2. A/B,
# 3 rounds alternating, 24 SMs. 3. taper sweep. 4. SM counts, token sweep, skewed routing, 4 ranks sharing
# the 2 GPUs (1x4), base and head. 5. bench nvlink with the local pattern (SM stores and TMA). 6. trace.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s105; mkdir -p $S; H=.device/moelink; Bb=.device/base/moelink
cm() { [ $1 = base ] && cat .device/base/COMMIT || cat .device/COMMIT; }
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o105 W=/tmp/w105 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 30 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 2 $S/soak.log
timeout -k 5 90 $H bench --mode ht --dtype all --num-sms 24 --reps 10 --json $S/head-checked.json > $S/head-checked.log 2>&1
echo "head checked rc=$? at $(el)"; grep -E "^ht " $S/head-checked.log
row() { grep -E "^ht " $1 | awk '{printf " %s/%s %s c%s |", $2,$3,$4,$8}'; echo; }
ht() { name=$1; w=$2; shift 2; b=$H; [ $w = base ] && b=$Bb
  env MOELINK_COMMIT=$(cm $w) "$@" timeout -k 5 90 $b bench --mode ht --dtype all --reps 20 --no-host-check --json $S/ht-$name.json ${ARGS:---num-sms 24} > $S/ht-$name.log 2>&1
  printf "%-18s rc=%s %s:" $name $? "$*"; row $S/ht-$name.log; }
for i in 1 2 3; do ht base-$i base; ht head-$i head; done
for i in 1 2; do for t in 0 640 1280; do ht taper$t-$i head MOELINK_HT_SEND_TAPER=$t; done; done
echo "ab done at $(el)"
for n in 8 16 32 48; do for w in base head; do ARGS="--num-sms $n" ht sms$n-$w $w; done; done
for w in base head; do ARGS="--num-sms 24 --tokens 512,1024,2048,8192" ht tok-$w $w; grep -E "^ht " $S/ht-tok-$w.log | awk '{print "   ", $0}'; done
for w in base head; do ARGS="--num-sms 24 --routing skewed" ht skew-$w $w; done
for w in base head; do ARGS="--num-sms 24 --ranks 4 --topology 1x4" CUDA_DEVICE_MAX_CONNECTIONS=32 ht share-$w $w; done
echo "sweeps done at $(el)"
timeout -k 5 90 $H bench nvlink --sms 4,8,14,24 --method sm,tma --pattern local,pair,all-to-all --no-jit --barrier-iters 100 --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -iE "local|pair|all-to-all" $S/nvlink.log | head -30
MOELINK_HT_TRACE=1 timeout -k 5 60 $H bench --mode ht --dtype all --num-sms 24 --reps 3 --warmup 1 --no-host-check --json $S/trace.json > $S/trace.log 2>&1
echo "trace rc=$? at $(el)"; grep "cached dispatch" $S/trace.log | cut -c1-330 | tail -4
echo "all done at $(el)"
cp /tmp/o105/*.json $S/ 2>/dev/null
tar -C /tmp -czf $OUT/call105.tgz s105
