#!/usr/bin/env bash
# Call 124 (2 x H200, a GPU per rank; issue 29): the internode HT dispatch.
#   263da79 = the hti kernels of fffbd96 (base); 9b0b287 = the emulated NIC's quiet loads every QP together;
#   head = df3b4e9: a forwarder loads a message's first payload batch with its header and meta words.
# 1. ht_internode + internode_gpu tests; HT soak 2x2 over the reordering emulated NIC.
# 2. 2x1 over emu-nic at 50 GB/s (16 NIC blocks): base / quiet / head, 2 rounds alternating; head checked.
# 3. 2x1 over ptr: base / head, 2 rounds. 4. head traced over emu-nic (FP8). 5. 2x2 (GPU-sharing) base / head.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s124; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=200 T_TEST_EACH=190 BUDGET_S=210 OUT=/tmp/o124 W=/tmp/w124 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 100 .device/moelink-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
  --families ht,ht-cached --time-budget-s 40 --hidden 2048,7168 --json $S/htsoak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 2 $S/soak.log
b() { name=$1; w=$2; tr=$3; shift 3
  timeout -k 5 150 env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit124-$w "$@" $(bin $w) bench --mode ht --json $S/$name.json $BARGS --transport $tr > $S/$name.log 2>&1
  printf "%-18s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10" b nic-head-checked head $NIC
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
for i in 1 2; do for w in 263da79 9b0b287 head; do b nic-$w-$i $w $NIC; done; done
echo "nic done at $(el)"
for i in 1 2; do for w in 263da79 head; do b ptr-$w-$i $w ptr; done; done
echo "ptr done at $(el)"
BARGS="--ranks 2 --topology 2x1 --dtype fp8 --reps 3 --no-host-check" b nic-head-traced head $NIC MOELINK_HT_TRACE=1
BARGS="--ranks 4 --topology 2x2 --dtype all --reps 5 --no-host-check"
for w in 263da79 head; do b nic2x2-$w $w $NIC; b ptr2x2-$w $w ptr; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call124.tgz s124
