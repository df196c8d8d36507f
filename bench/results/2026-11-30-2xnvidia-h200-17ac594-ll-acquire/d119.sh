#!/usr/bin/env bash
# Call 119 (2 x H200, issue 31): the one-node LL kernels. head = 17ac594 (remote waits acquire by loading the
# arrival words again, not by a system fence); prev = 87f0e8e (the one-node LL kernels of 6b7cc55).
# 1. moelink.test.ll and ll_cuda at 2 ranks; LL soak 2 ranks. 2. A/B EP2, traced, 3 rounds alternating.
# 3. token sweep prev/head. 4. 1x4 (two ranks a GPU) prev/head.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s119; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o119 W=/tmp/w119 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 40 .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-prereduced,ll-hook --time-budget-s 20 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 4 $S/soak.log
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ll --ranks 2 --reps 30 --ll-trace --json $S/$name.json "$@" > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ll " $S/$name.log | awk '{printf " %s %s %s |", $2, $3, $4}'
  python3 scripts/ll-trace-points.py $S/$name.json | grep "back to back (DeepEP" | sed 's/.*method)://' ; }
ll checked-head head
for i in 1 2 3; do for w in 87f0e8e head; do ll $w-$i $w --no-host-check; done; done
echo "ab done at $(el)"
for w in 87f0e8e head; do ll tok-$w $w --no-host-check --tokens 1,16,64,256; done
for w in 87f0e8e head; do
  env MOELINK_COMMIT=$(cm $w) CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 60 $(bin $w) bench --mode ll --ranks 4 --topology 1x4 --reps 30 --no-host-check \
    --json $S/share-$w.json > $S/share-$w.log 2>&1
  printf "%-16s rc=%s:" share-$w $?; grep -E "^ll " $S/share-$w.log | awk '{printf " %s %s %s |", $2, $3, $4}'; echo
done
python3 scripts/ll-trace-points.py $S/*-1.json > $S/points.txt 2>&1; grep "back-to-back" $S/points.txt | cut -c1-300
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call119.tgz s119
