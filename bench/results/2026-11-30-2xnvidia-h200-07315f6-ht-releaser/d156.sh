#!/usr/bin/env bash
# Call 156 (2 x H200, a GPU per rank; issue 31): the releaser's mailbox two batches deep (a sender posts its
# next batch while the releaser still fences the one before). head = 07315f6 + depth2.patch (.device/moelink);
# d1 = 07315f6 (.device/exp/moelink-07315f6, one batch deep). Configurations: old (MOELINK_HT_RELEASER=0
# MOELINK_HT_RELEASE_BATCH=4, 7e2d94b's kernels), the defaults of d1 and head, and for the FP8 dispatch the
# releaser with batches of 4, 3 and 2 (head; MOELINK_HT_RELEASER=1 sets it for every kernel of the run).
# 1. moelink.test.ht (head, defaults and the releaser everywhere); 2. EP2 alternated; 3. token sweep + skewed;
# 4. EP4 two ranks per GPU; 5. HT soaks.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s156; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 \
  OUT=/tmp/o156 W=/tmp/w156 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
MOELINK_HT_RELEASER=1 STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 \
  OUT=/tmp/o156r W=/tmp/w156r bash scripts/device/run.sh > $S/tests-releaser.log 2>&1
echo "tests-releaser rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests-releaser.log | head -8
ht() { name=$1; cfg=$2; shift 2
  B=.device/moelink; C=$(cat .device/COMMIT)
  case $cfg in
    old) envs="MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4";;
    head) envs="";;
    d1) envs=""; B=.device/exp/moelink-07315f6; C=07315f6;;
    r1b4) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=4";;
    r1b3) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=3";;
    r1b2) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2";;
  esac
  env MOELINK_COMMIT=$C $envs timeout -k 5 120 $B bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s/%s |", $2, $3, (NF==11 ? $4"-"$5 : ""), $(NF-5), $(NF-1)}'; echo; }
for i in 1 2; do for c in old d1 head r1b4 r1b3 r1b2; do ht real-$c-$i $c --ranks 2; done; done
echo "bench done at $(el)"
for c in old d1 head r1b4 r1b2; do ht sweep-$c $c --ranks 2 --tokens 512,1024,2048 --routing uniform,skewed; done
for c in old head r1b4; do CUDA_DEVICE_MAX_CONNECTIONS=32 ht ep4-$c $c --ranks 4 --topology 1x4; done
echo "sweeps done at $(el)"
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 20 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2 timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 15 --hidden 2048,7168 --json $S/htsoak-r1b2.json > $S/htsoak-r1b2.log 2>&1
echo "htsoak-r1b2 rc=$? at $(el)"; tail -n 2 $S/htsoak-r1b2.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call156.tgz s156
