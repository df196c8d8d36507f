#!/usr/bin/env bash
# Call 146 (2 x H200, a GPU per rank; issue 31): call 145's TMA senders kept one load in flight per warp
# (slower: cached BF16 190 -> 222 us). Now each warp streams its chunk's rows through 3 slots of 3.5 KiB, two
# loads ahead (tma1), or 6 slots of 1.75 KiB, five ahead (p2k6, an experiment build). base = 5931f4f's build,
# tma0 = head with vector stores (the per-destination meta words only).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s146; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
MOELINK_HT_SEND_TMA=1 STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 \
  OUT=/tmp/o146 W=/tmp/w146 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests (tma1) rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
bin() { case $1 in base) echo .device/exp/moelink-base;; p2k6) echo .device/exp/moelink-p2k6;; *) echo .device/moelink;; esac; }
cm() { case $1 in base) echo 5931f4f;; *) echo "$(cat .device/COMMIT)-$1";; esac; }
tma() { case $1 in tma0|base) echo 0;; *) echo 1;; esac; }
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) MOELINK_HT_SEND_TMA=$(tma $w) timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-18s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s %s |", $2, $3, $4, $8, $NF}'; echo; }
for i in 1 2; do for w in base tma0 tma1 p2k6; do ht real-$w-$i $w; done; done
echo "bench done at $(el)"
for w in base tma1 p2k6; do MOELINK_HT_TIMING_EXPERIMENT=5 ht send-$w $w --no-host-check; done
for n in 8 12; do MOELINK_HT_DISPATCH_SEND_BLOCKS=$n ht split$n-tma1 tma1; MOELINK_HT_DISPATCH_SEND_BLOCKS=$n ht split$n-p2k6 p2k6; done
echo "senders/split done at $(el)"
MOELINK_HT_SEND_TMA=1 timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 30 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak (tma1) rc=$? at $(el)"; tail -n 2 $S/htsoak.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call146.tgz s146
