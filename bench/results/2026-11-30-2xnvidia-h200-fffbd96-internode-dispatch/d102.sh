#!/usr/bin/env bash
# Call 102 (2 x H200, issue 29): fffbd96 (the internode HT dispatch's own role split: forwarders 3/8 of the
# blocks, receivers half the rest) against base fa7e461 (the shared split) at 24 SMs, and against its own
# kernels with the old split forced through the tuning variables at 16, 32 and 48 SMs. 1. moelink.test.ht_internode
# and internode_gpu; 2. 2x1 over ptr (thread mode, a GPU per rank): head checked, base/head 3 rounds; the SM
# sweep; 3. procbench over nvshmem and ptr; 4. the emulated NIC at 50 GB/s, 2x1 and 2x2; 2x2 over ptr
# (4 ranks on 2 GPUs: GPU-sharing figures); 5. the HT soak on 2x2 over the reordering emulated NIC.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s102; mkdir -p $S; H=.device/moelink
t0=$(date +%s)
cm() { case $1 in base) echo fa7e461;; *) cat .device/COMMIT;; esac; }
bin() { case $1 in base) echo .device/base/moelink;; *) echo $H;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" MOELINK_TEST_RANKS=2 MOELINK_TEST_RANKS_INTERNODE=8 \
  T_TESTS=200 T_TEST_EACH=150 BUDGET_S=210 OUT=/tmp/o102 W=/tmp/w102 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
n21() { w=$1; shift; MOELINK_COMMIT="$(cm $w)" timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all "$@"; }
n21 head --num-sms 24 --reps 10 --json $S/n21-head-checked.json > $S/n21-head-checked.log 2>&1
echo "2x1 head checked rc=$? at $(el)"; grep -E "^ht " $S/n21-head-checked.log | cut -c1-80
for i in 1 2 3; do for w in base head; do
  n21 $w --num-sms 24 --reps 20 --no-host-check --json $S/n21-$w-$i.json > $S/n21-$w-$i.log 2>&1
  echo "2x1 $w $i rc=$? at $(el)"; grep -E "^ht " $S/n21-$w-$i.log | cut -c1-80; done; done
for sms_old in 16:5:7 32:10:12 48:16:17; do IFS=: read sms f s <<< "$sms_old"
  MOELINK_HTI_FWD_BLOCKS=$f MOELINK_HT_DISPATCH_SEND_BLOCKS=$s n21 head --num-sms $sms --reps 20 --no-host-check --json $S/sms$sms-old.json > $S/sms$sms-old.log 2>&1
  echo "sms $sms old split (fwd $f send $s) rc=$? at $(el)"; grep -E "^ht " $S/sms$sms-old.log | cut -c1-80
  n21 head --num-sms $sms --reps 20 --no-host-check --json $S/sms$sms-new.json > $S/sms$sms-new.log 2>&1
  echo "sms $sms new split rc=$? at $(el)"; grep -E "^ht " $S/sms$sms-new.log | cut -c1-80; done
STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem ptr" PROCBENCH_ARGS="--mode all --reps 10 --num-sms 24" T_PROCBENCH=160 BUDGET_S=170 \
  OUT=/tmp/o102p W=/tmp/w102p bash scripts/device/run.sh > $S/procbench.log 2>&1
echo "procbench rc=$? at $(el)"; grep -E "^(ht|ll) " $S/procbench.log | cut -c1-80 | head -12
cp /tmp/o102p/*.json $S/ 2>/dev/null
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 80 $H bench --mode ht --ranks 2 --topology 2x1 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/nic-2x1.json > $S/nic-2x1.log 2>&1
echo "nic 2x1 rc=$? at $(el)"; grep -E "^ht " $S/nic-2x1.log | cut -c1-80
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $H bench --mode ht --ranks 4 --topology 2x2 --transport ptr --num-sms 24 --reps 10 \
  --json $S/n22-ptr.json > $S/n22-ptr.log 2>&1
echo "2x2 ptr rc=$? at $(el)"; grep -E "^ht " $S/n22-ptr.log | cut -c1-80
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 70 $H bench --mode ht --ranks 4 --topology 2x2 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/n22-nic.json > $S/n22-nic.log 2>&1
echo "2x2 nic rc=$? at $(el)"; grep -E "^ht " $S/n22-nic.log | cut -c1-80
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 100 $H-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
  --families ht,ht-cached --time-budget-s 40 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call102.tgz s102
