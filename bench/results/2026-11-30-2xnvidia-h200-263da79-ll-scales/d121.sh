#!/usr/bin/env bash
# Call 121 (1 x H200, issue 31): the one-node LL dispatch, two ranks sharing one GPU (no x2 lent).
# head = 263da79 (a row's scales loaded one item ahead with its payload in the receive); prev = 17ac594 (the
# same kernels as ea8519f's). 1. moelink.test.ll and ll_cuda; LL soak 2 ranks. 2. A/B 1x2 sharing the GPU,
# 33 SMs a rank, traced, 3 rounds alternating. 3. token sweep prev/head.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s121; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o121 W=/tmp/w121 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 40 .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-prereduced,ll-hook --time-budget-s 20 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 4 $S/soak.log
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) MOELINK_LL_SMS=33 timeout -k 5 60 $(bin $w) bench --mode ll --ranks 2 --topology 1x2 --reps 30 --ll-trace --json $S/$name.json "$@" > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ll " $S/$name.log | awk '{printf " %s %s %s |", $2, $3, $4}'
  python3 scripts/ll-trace-points.py $S/$name.json | grep "back to back (DeepEP" | sed 's/.*method)://' ; }
ll checked-head head
for i in 1 2 3; do for w in 17ac594 head; do ll $w-$i $w --no-host-check; done; done
echo "ab done at $(el)"
for w in 17ac594 head; do ll tok-$w $w --no-host-check --tokens 1,16,64,256; done
python3 scripts/ll-trace-points.py $S/*-1.json > $S/points.txt 2>&1; grep "back-to-back" $S/points.txt | cut -c1-330
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call121.tgz s121
