#!/usr/bin/env bash
# Call 91 (2 x H200): a13706d, the HT dispatch senders' layout check after the token's payload (fresh
# dispatch only), against base 7b09642 (whose HT kernels are the parent's). 1. moelink.test.ht at 2 ranks and
# moelink.test.ht_internode (virtual nodes, ranks sharing the GPUs); 2. the HT soak; 3. one node at EP2,
# DeepEP's shapes, 24 SMs: head checked against the host, then A/B 3 rounds alternating; 4. across nodes, 2x1
# over ptr (thread mode, a GPU per rank): head checked, then A/B 3 rounds; 5. head in process mode over
# nvshmem and ptr (procbench), issue 29's setting.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=$OUT/s91; mkdir -p $S; H=.device/moelink; Bb=.device/base/moelink
t0=$(date +%s)
cm() { case $1 in base) echo 7b09642;; *) cat .device/COMMIT;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.ht moelink.test.ht_internode" MOELINK_TEST_RANKS=2 MOELINK_TEST_RANKS_INTERNODE=8 \
  T_TESTS=170 T_TEST_EACH=120 BUDGET_S=180 OUT=/tmp/o91 W=/tmp/w91 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -6
timeout -k 5 50 $H-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 25 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 1 $S/soak.log
timeout -k 5 120 $H bench --mode ht --dtype all --num-sms 24 --reps 30 --json $S/head-checked.json > $S/head-checked.log 2>&1
echo "head checked rc=$? at $(el)"; grep -E "^ht " $S/head-checked.log
for i in 1 2 3; do for w in base head; do b=$H; [ $w = base ] && b=$Bb
  MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $b bench --mode ht --dtype all --num-sms 24 --reps 30 --no-host-check --json $S/ab-$w-$i.json > $S/ab-$w-$i.log 2>&1
  echo "ab $w $i rc=$? at $(el)"; grep -E "^ht " $S/ab-$w-$i.log; done; done
timeout -k 5 120 $H bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 --reps 10 --json $S/n21-head-checked.json > $S/n21-head-checked.log 2>&1
echo "2x1 head checked rc=$? at $(el)"; grep -E "^ht " $S/n21-head-checked.log
for i in 1 2 3; do for w in base head; do b=$H; [ $w = base ] && b=$Bb
  MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $b bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 --reps 20 --no-host-check \
    --json $S/n21-$w-$i.json > $S/n21-$w-$i.log 2>&1
  echo "2x1 $w $i rc=$? at $(el)"; grep -E "^ht " $S/n21-$w-$i.log; done; done
STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem ptr" PROCBENCH_ARGS="--mode all --reps 10 --num-sms 24" T_PROCBENCH=150 BUDGET_S=160 \
  OUT=/tmp/o91p W=/tmp/w91p bash scripts/device/run.sh > $S/procbench.log 2>&1
echo "procbench rc=$? at $(el)"; grep -E "^(ht|ll) " $S/procbench.log | head -12
cp /tmp/o91p/*.json /tmp/o91/*.json $S/ 2>/dev/null
echo "all done at $(el)"
gzip -q $S/*.json 2>/dev/null; true
