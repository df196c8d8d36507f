#!/usr/bin/env bash
# Call 107 (2 x H200, issue 31): the HT combine reducers with the prefix a token ahead and one acquire poll
# per row (head = 253a25d) against base fa7e461 (combine of 019ae9b); c16l16 / c14l18: head's source built
# with HtCombineVariant::WARPS / REDUCE_LOAD_VECS = 16 / 16 and 14 / 18 (experiment builds, not committed).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s107; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; base) echo .device/base/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; base) cat .device/base/COMMIT;; *) echo "$(cat .device/COMMIT)-$1";; esac; }
row() { grep -E "^ht " $1 | awk '{printf " %s/%s %s c%s %s |", $2,$3,$4,$8,$9}'; echo; }
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o107 W=/tmp/w107 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 30 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 1 $S/soak.log
for w in head c16l16 c14l18; do
  MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $(bin $w) bench --mode ht --dtype all --num-sms 24 --reps 5 --json $S/checked-$w.json > $S/checked-$w.log 2>&1
  printf "%-18s rc=%s:" checked-$w $?; row $S/checked-$w.log; done
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) "$@" timeout -k 5 90 $(bin $w) bench --mode ht --dtype ${DT:-bf16} --reps 20 --no-host-check --json $S/ht-$name.json ${ARGS:---num-sms 24} > $S/ht-$name.log 2>&1
  printf "%-22s rc=%s %s:" $name $? "$*"; row $S/ht-$name.log; }
for i in 1 2 3; do for w in base head c16l16 c14l18; do ht $w-$i $w; done; done
for w in base head c16l16; do ht exp6-$w $w MOELINK_HT_TIMING_EXPERIMENT=6; ht exp5-$w $w MOELINK_HT_TIMING_EXPERIMENT=5; done
echo "ab done at $(el)"
for n in 8 16 32 48; do for w in base head c16l16 c14l18; do ARGS="--num-sms $n" ht sms$n-$w $w; done; done
for w in base head c16l16; do ARGS="--num-sms 24 --tokens 512,1024,2048,8192" ht tok-$w $w; grep -E "^ht " $S/ht-tok-$w.log | grep combine | awk '{print "   ", $4, $5}' | tr '\n' ' '; echo; done
for w in base head c16l16; do ARGS="--num-sms 24 --routing skewed" ht skew-$w $w; done
for w in base head c16l16 c14l18; do ARGS="--num-sms 24 --ranks 4 --topology 1x4" CUDA_DEVICE_MAX_CONNECTIONS=32 ht share-$w $w; done
echo "sweeps done at $(el)"
for w in head c16l16; do
  MOELINK_HT_TRACE=1 MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ht --dtype bf16 --num-sms 24 --reps 3 --warmup 1 --no-host-check --json $S/trace-$w.json > $S/trace-$w.log 2>&1
  echo "trace $w rc=$?"; grep "combine" $S/trace-$w.log | grep "moelink trace" | cut -c1-330 | tail -2; done
echo "all done at $(el)"
cp /tmp/o107/*.json $S/ 2>/dev/null
tar -C /tmp -czf $OUT/call107.tgz s107
