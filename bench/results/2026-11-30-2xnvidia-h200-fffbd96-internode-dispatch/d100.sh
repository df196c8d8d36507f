#!/usr/bin/env bash
# Call 100 (2 x H200, issue 29): 47a71c6, internode HT dispatch senders staging two tokens per grab and fence,
# against base 45d91c1 (meta words before the payload, one token per grab) and two variants of head: g4 (four
# tokens per grab) and u14 (14-vector row batches for forwarders and receivers). 1. moelink.test.ht_internode
# and internode_gpu; 2. the HT soak on 2x2 over the reordering emulated NIC; 3. 2x1 over ptr (thread mode, a
# GPU per rank): head, g4 and u14 checked against the host, then base/head/g4/u14 alternating 3 rounds;
# 4. MOELINK_HT_TRACE of head; 5. procbench (process mode) over nvshmem and ptr; 6. 2x1 over the emulated NIC
# at 50 GB/s; 7. 2x2 (4 ranks on the 2 GPUs: GPU-sharing figures) over ptr and the emulated NIC.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s100; mkdir -p $S; H=.device/moelink
t0=$(date +%s)
cm() { case $1 in base) echo 45d91c1;; head) cat .device/COMMIT;; *) echo "$(cat .device/COMMIT)+$1";; esac; }
bin() { case $1 in base) echo .device/base/moelink;; head) echo $H;; *) echo .device/$1/moelink;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" MOELINK_TEST_RANKS=2 MOELINK_TEST_RANKS_INTERNODE=8 \
  T_TESTS=200 T_TEST_EACH=150 BUDGET_S=210 OUT=/tmp/o100 W=/tmp/w100 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 110 $H-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
  --families ht,ht-cached --time-budget-s 50 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
n21() { w=$1; shift; MOELINK_COMMIT="$(cm $w)" timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 "$@"; }
for w in head g4 u14; do n21 $w --reps 10 --json $S/n21-$w-checked.json > $S/n21-$w-checked.log 2>&1
  echo "2x1 $w checked rc=$? at $(el)"; grep -E "^ht " $S/n21-$w-checked.log | cut -c1-80; done
for i in 1 2 3; do for w in base head g4 u14; do
  n21 $w --reps 20 --no-host-check --json $S/n21-$w-$i.json > $S/n21-$w-$i.log 2>&1
  echo "2x1 $w $i rc=$? at $(el)"; grep -E "^ht " $S/n21-$w-$i.log | cut -c1-80; done; done
MOELINK_HT_TRACE=1 n21 head --reps 5 --warmup 2 --no-host-check --json $S/trace-head.json > $S/trace-head.log 2>&1
echo "trace head rc=$? at $(el)"
STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem ptr" PROCBENCH_ARGS="--mode all --reps 10 --num-sms 24" T_PROCBENCH=160 BUDGET_S=170 \
  OUT=/tmp/o100p W=/tmp/w100p bash scripts/device/run.sh > $S/procbench.log 2>&1
echo "procbench rc=$? at $(el)"; grep -E "^(ht|ll) " $S/procbench.log | cut -c1-80 | head -12
cp /tmp/o100p/*.json $S/ 2>/dev/null
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 80 $H bench --mode ht --ranks 2 --topology 2x1 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/nic-2x1.json > $S/nic-2x1.log 2>&1
echo "nic 2x1 rc=$? at $(el)"; grep -E "^ht " $S/nic-2x1.log | cut -c1-80
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $H bench --mode ht --ranks 4 --topology 2x2 --transport ptr --num-sms 24 --reps 10 \
  --json $S/n22-ptr.json > $S/n22-ptr.log 2>&1
echo "2x2 ptr rc=$? at $(el)"; grep -E "^ht " $S/n22-ptr.log | cut -c1-80
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 70 $H bench --mode ht --ranks 4 --topology 2x2 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/n22-nic.json > $S/n22-nic.log 2>&1
echo "2x2 nic rc=$? at $(el)"; grep -E "^ht " $S/n22-nic.log | cut -c1-80
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call100.tgz s100
