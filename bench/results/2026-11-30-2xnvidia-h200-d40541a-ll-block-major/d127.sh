#!/usr/bin/env bash
# Call 127 (2 x H200, issue 31): the LL dispatch receive's items dealt block-major. head = d40541a; prev =
# be3734e (the LL kernels of 263da79). 1. moelink.test.ll, ll_cuda, ll_internode_gpu; LL soak 2 ranks.
# 2. One node, EP2: A/B traced, 3 rounds alternating; token sweep. 3. 2x1 over ptr (the internode LL kernels), 2 rounds.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s127; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda moelink.test.ll_internode_gpu" T_TESTS=150 T_TEST_EACH=90 BUDGET_S=160 OUT=/tmp/o127 W=/tmp/w127 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 40 .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-prereduced,ll-hook --time-budget-s 15 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 2 $S/soak.log
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ll --ranks 2 --reps 30 --ll-trace --json $S/$name.json "$@" > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ll " $S/$name.log | awk '{printf " %s %s %s |", $2, $3, $4}'
  python3 scripts/ll-trace-points.py $S/$name.json | grep "back to back (DeepEP" | sed 's/.*method)://' ; }
ll checked-head head
for i in 1 2 3; do for w in be3734e head; do ll $w-$i $w --no-host-check; done; done
echo "ab done at $(el)"
for w in be3734e head; do ll tok-$w $w --no-host-check --tokens 1,16,64,256; done
for i in 1 2; do for w in be3734e head; do ll lli-$w-$i $w --no-host-check --topology 2x1 --transport ptr; done; done
python3 scripts/ll-trace-points.py $S/*-1.json > $S/points.txt 2>&1; grep "back-to-back dispatch" $S/points.txt | cut -c1-330
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call127.tgz s127
