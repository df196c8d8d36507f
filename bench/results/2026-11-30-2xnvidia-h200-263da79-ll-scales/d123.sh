#!/usr/bin/env bash
# Call 123 (2 x H200, a GPU per rank; issues 31 and 29).
# 1. One-node LL dispatch, EP2: head = 263da79 (a row's scales loaded one item ahead with its payload in the
#    receive) against prev = 17ac594 (the kernels of ea8519f): tests, soak, 3 rounds alternating (traced, back
#    to back), token sweep, 1x4 (two ranks a GPU).
# 2. Issue 29: the HT dispatch over the emulated NIC at 50 GB/s, 2x1 (the hti kernels of fffbd96): BF16/FP8 10
#    reps, FP8 traced, FP8 over ptr.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s123; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" T_TESTS=100 T_TEST_EACH=90 BUDGET_S=110 OUT=/tmp/o123 W=/tmp/w123 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 40 .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-prereduced,ll-hook --time-budget-s 20 \
  --json $S/soak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 2 $S/soak.log
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ll --ranks 2 --reps 30 --ll-trace --json $S/$name.json "$@" > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ll " $S/$name.log | awk '{printf " %s %s %s |", $2, $3, $4}'
  python3 scripts/ll-trace-points.py $S/$name.json | grep "back to back (DeepEP" | sed 's/.*method)://' ; }
ll checked-head head
for i in 1 2 3; do for w in 17ac594 head; do ll $w-$i $w --no-host-check; done; done
echo "ab done at $(el)"
for w in 17ac594 head; do ll tok-$w $w --no-host-check --tokens 1,16,64,256; done
for w in 17ac594 head; do
  env MOELINK_COMMIT=$(cm $w) CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 60 $(bin $w) bench --mode ll --ranks 4 --topology 1x4 --reps 30 --no-host-check \
    --json $S/share-$w.json > $S/share-$w.log 2>&1
  printf "%-16s rc=%s:" share-$w $?; grep -E "^ll " $S/share-$w.log | awk '{printf " %s %s %s |", $2, $3, $4}'; echo
done
python3 scripts/ll-trace-points.py $S/*-1.json > $S/points.txt 2>&1; grep "back-to-back dispatch" $S/points.txt | cut -c1-330
echo "ll done at $(el)"
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
b() { name=$1; shift
  timeout -k 5 150 env "$@" .device/moelink bench --mode ht --ranks 2 --topology 2x1 --transport $NIC --json $S/$name.json $BARGS > $S/$name.log 2>&1
  echo "$name rc=$?"; grep -E "^ht " $S/$name.log | cut -c1-200 | head -6; }
BARGS="--dtype all --reps 10" b nic
BARGS="--dtype fp8 --reps 3 --no-host-check" b nic-fp8-traced MOELINK_HT_TRACE=1
NIC=ptr BARGS="--dtype fp8 --reps 10 --no-host-check" b ptr-fp8 MOELINK_X=0
grep -c "moelink trace" $S/nic-fp8-traced.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call123.tgz s123
