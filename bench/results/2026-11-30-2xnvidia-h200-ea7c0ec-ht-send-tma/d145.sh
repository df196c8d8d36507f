#!/usr/bin/env bash
# Call 145 (2 x H200, a GPU per rank; issue 31): the HT dispatch senders moving the payload by TMA bulk copies
# through shared memory (MOELINK_HT_SEND_TMA=1), the per-destination meta-word stores in both modes.
#   base = 5931f4f's build (the kernels of ea7c0ec); head = ea7c0ec + the TMA change, TMA off (tma0) and on (tma1).
# 1. moelink.test.ht with TMA on (the HT test bodies, CUDA against the host backend); 2. the bench checked bit
# for bit against the host, alternated; 3. senders alone (timing experiment 5); 4. sender-block split with TMA;
# 5. the HT soak with TMA on.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s145; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
MOELINK_HT_SEND_TMA=1 STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 \
  OUT=/tmp/o145 W=/tmp/w145 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests (tma1) rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
bin() { case $1 in base) echo .device/exp/moelink-base;; *) echo .device/moelink;; esac; }
cm() { case $1 in base) echo 5931f4f;; *) echo "$(cat .device/COMMIT)-$1";; esac; }
tma() { case $1 in tma1) echo 1;; *) echo 0;; esac; }
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) MOELINK_HT_SEND_TMA=$(tma $w) timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-18s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s %s |", $2, $3, $4, $8, $NF}'; echo; }
for i in 1 2; do for w in base tma0 tma1; do ht real-$w-$i $w; done; done
echo "bench done at $(el)"
for w in base tma0 tma1; do MOELINK_HT_TIMING_EXPERIMENT=5 ht send-$w $w --no-host-check; done
for n in 8 12 14; do MOELINK_HT_DISPATCH_SEND_BLOCKS=$n ht split$n-tma1 tma1; done
echo "senders/split done at $(el)"
MOELINK_HT_SEND_TMA=1 timeout -k 5 80 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 45 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak (tma1) rc=$? at $(el)"; tail -n 2 $S/htsoak.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call145.tgz s145
