#!/usr/bin/env bash
# Call 166 (1 x H200, the ranks sharing it: no 2-GPU machine was lent; issue 29): head = compact dispatch messages (i16 slots, 64 bytes) over the
# emulated NIC only, every chunk in forwarder units over a NIC, and the emulated NIC's blocks checking the QPs
# drained a lane each at a launch's end; base = ddd1507 (.device/exp/moelink-base).
# 1. ht_internode + internode_gpu + ll_internode_gpu tests (head). 2. 2x1 over emu-nic at 50 GB/s, head
# checked, then base / head alternated 3 rounds, then head traced (FP8). 3. 2x1 over ptr, 2 rounds. 4. HT soak
# 2x2 over the reordering emulated NIC (head), 60 s.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s166; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo ddd1507;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu moelink.test.ll_internode_gpu" T_TESTS=200 T_TEST_EACH=140 BUDGET_S=210 OUT=/tmp/o166 W=/tmp/w166 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
b() { name=$1; w=$2; tr=$3; shift 3
  timeout -k 5 150 env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit166-$w "$@" $(bin $w) bench --mode ht --json $S/$name.json $BARGS --transport $tr > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10" b nic-head-checked head $NIC
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
for i in 1 2 3; do for w in base head; do b nic-$w-$i $w $NIC; done; done
BARGS="--ranks 2 --topology 2x1 --dtype fp8 --reps 10 --no-host-check"
b nic-head-traced head $NIC MOELINK_HT_TRACE=1
echo "nic done at $(el)"
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
for i in 1 2; do for w in base head; do b ptr-$w-$i $w ptr; done; done
echo "ptr done at $(el)"
timeout -k 5 110 env MOELINK_CACHE_DIR=/tmp/jit166-head .device/moelink-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
  --families ht,ht-cached --time-budget-s 60 --hidden 2048,7168 --json $S/htsoak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el): $(grep -E '^\[soak\]|^soak:' $S/soak.log | tr '\n' ' ' | cut -c1-300)"
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call166.tgz s166
