#!/usr/bin/env bash
# Call 99 (2 x H200, issue 29): 45d91c1, the internode HT dispatch's forwarders and receivers loading a row's
# meta words before its payload, against base d05fc76 (the parent's kernels) and exp (45d91c1 plus 14-vector
# row batches: one load latency per FP8 row, two per bf16 row; spills 8-84 B). 1. moelink.test.ht_internode
# (virtual nodes, 8 ranks sharing the GPUs) and internode_gpu; 2. the HT soak on 2x2 over the reordering
# emulated NIC; 3. 2x1 over ptr (thread mode, a GPU per rank): head and exp checked against the host, then
# base/head/exp alternating 3 rounds; 4. MOELINK_HT_TRACE of base and head; 5. procbench (process mode) over
# nvshmem and ptr; 6. 2x1 over the emulated NIC at 50 GB/s.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s99; mkdir -p $S; H=.device/moelink; Bb=.device/base/moelink; X=.device/exp/moelink
t0=$(date +%s)
cm() { case $1 in base) echo d05fc76;; exp) echo "$(cat .device/COMMIT)+u14";; *) cat .device/COMMIT;; esac; }
bin() { case $1 in base) echo $Bb;; exp) echo $X;; *) echo $H;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" MOELINK_TEST_RANKS=2 MOELINK_TEST_RANKS_INTERNODE=8 \
  T_TESTS=200 T_TEST_EACH=150 BUDGET_S=210 OUT=/tmp/o99 W=/tmp/w99 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 110 $H-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
  --families ht,ht-cached --time-budget-s 50 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
n21() { w=$1; shift; MOELINK_COMMIT="$(cm $w)" timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 "$@"; }
for w in head exp; do n21 $w --reps 10 --json $S/n21-$w-checked.json > $S/n21-$w-checked.log 2>&1
  echo "2x1 $w checked rc=$? at $(el)"; grep -E "^ht " $S/n21-$w-checked.log | cut -c1-80; done
for i in 1 2 3; do for w in base head exp; do
  n21 $w --reps 20 --no-host-check --json $S/n21-$w-$i.json > $S/n21-$w-$i.log 2>&1
  echo "2x1 $w $i rc=$? at $(el)"; grep -E "^ht " $S/n21-$w-$i.log | cut -c1-80; done; done
for w in base head; do MOELINK_HT_TRACE=1 n21 $w --reps 5 --warmup 2 --no-host-check --json $S/trace-$w.json > $S/trace-$w.log 2>&1
  echo "trace $w rc=$? at $(el)"; done
STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem ptr" PROCBENCH_ARGS="--mode all --reps 10 --num-sms 24" T_PROCBENCH=160 BUDGET_S=170 \
  OUT=/tmp/o99p W=/tmp/w99p bash scripts/device/run.sh > $S/procbench.log 2>&1
echo "procbench rc=$? at $(el)"; grep -E "^(ht|ll) " $S/procbench.log | cut -c1-80 | head -12
cp /tmp/o99p/*.json $S/ 2>/dev/null
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 80 $H bench --mode ht --ranks 2 --topology 2x1 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/nic-2x1.json > $S/nic-2x1.log 2>&1
echo "nic rc=$? at $(el)"; grep -E "^ht " $S/nic-2x1.log | cut -c1-80
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call99.tgz s99
