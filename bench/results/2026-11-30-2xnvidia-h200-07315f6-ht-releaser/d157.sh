#!/usr/bin/env bash
# Call 157 (2 x H200, a GPU per rank; issue 31): the final build 1ee3baa (07315f6's defaults with the sender
# frame shared in ht.cuh) checked and timed against the old defaults (MOELINK_HT_RELEASER=0
# MOELINK_HT_RELEASE_BATCH=4) in the same binary, and the FP8 dispatch with the releaser and batches of 3 or
# 4 (MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=3/4: every kernel of those runs; only their FP8 rows
# are read). 1. moelink.test.ht, defaults and the releaser everywhere; 2. EP2 alternated; 3. sweeps; 4. soak.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s157; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 \
  OUT=/tmp/o157 W=/tmp/w157 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
MOELINK_HT_RELEASER=1 STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 \
  OUT=/tmp/o157r W=/tmp/w157r bash scripts/device/run.sh > $S/tests-releaser.log 2>&1
echo "tests-releaser rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests-releaser.log | head -8
ht() { name=$1; cfg=$2; shift 2
  case $cfg in
    old) envs="MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4";;
    head) envs="";;
    r1b4) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=4";;
    r1b3) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=3";;
  esac
  env $envs timeout -k 5 120 .device/moelink bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s/%s |", $2, $3, (NF==11 ? $4"-"$5 : ""), $(NF-5), $(NF-1)}'; echo; }
for i in 1 2; do for c in old head r1b3 r1b4; do ht real-$c-$i $c --ranks 2; done; done
echo "bench done at $(el)"
for c in old head r1b3 r1b4; do ht sweep-$c $c --ranks 2 --tokens 512,1024,2048 --routing uniform,skewed; done
echo "sweeps done at $(el)"
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 20 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call157.tgz s157
