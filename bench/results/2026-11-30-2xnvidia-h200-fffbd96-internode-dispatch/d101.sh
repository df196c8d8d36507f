#!/usr/bin/env bash
# Call 101 (2 x H200, issue 29): fa7e461 (the internode HT dispatch: meta words before the payload, two tokens
# per sender grab, 14-vector row batches) against base d05fc76 (the session's start). 1. moelink.test.ht_internode
# and internode_gpu; the HT soak on 2x2 over the reordering emulated NIC; kill-a-rank (htchaos) over emu-nic and
# nvshmem; 2. 2x1 over ptr (thread mode, a GPU per rank): head checked, then base/head 3 rounds; 3. head's role
# split swept (MOELINK_HTI_FWD_BLOCKS, MOELINK_HT_DISPATCH_SEND_BLOCKS), 2 rounds; 4. procbench over nvshmem
# and ptr; 5. the emulated NIC at 50 GB/s, 2x1; 6. 2x2 (4 ranks on 2 GPUs: GPU-sharing figures) over ptr,
# base and head, and over the emulated NIC.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s101; mkdir -p $S; H=.device/moelink
t0=$(date +%s)
cm() { case $1 in base) echo d05fc76;; *) cat .device/COMMIT;; esac; }
bin() { case $1 in base) echo .device/base/moelink;; *) echo $H;; esac; }
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" MOELINK_TEST_RANKS=2 MOELINK_TEST_RANKS_INTERNODE=8 \
  T_TESTS=200 T_TEST_EACH=150 BUDGET_S=210 OUT=/tmp/o101 W=/tmp/w101 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 100 $H-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
  --families ht,ht-cached --time-budget-s 30 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
STEPS=internode INTERNODE_STEPS=htchaos T_INTERNODE=150 BUDGET_S=160 OUT=/tmp/o101c W=/tmp/w101c bash scripts/device/run.sh > $S/htchaos.log 2>&1
echo "htchaos rc=$? at $(el)"; grep -E "htchaos" $S/htchaos.log | grep -E "PASS|FAIL|rc=" | head -8
mkdir -p $S/htchaos; cp -r /tmp/w101c/internode /tmp/w101c/internode-work/htchaos-* $S/htchaos/ 2>/dev/null
n21() { w=$1; shift; MOELINK_COMMIT="$(cm $w)" timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 "$@"; }
n21 head --reps 10 --json $S/n21-head-checked.json > $S/n21-head-checked.log 2>&1
echo "2x1 head checked rc=$? at $(el)"; grep -E "^ht " $S/n21-head-checked.log | cut -c1-80
for i in 1 2 3; do for w in base head; do
  n21 $w --reps 20 --no-host-check --json $S/n21-$w-$i.json > $S/n21-$w-$i.log 2>&1
  echo "2x1 $w $i rc=$? at $(el)"; grep -E "^ht " $S/n21-$w-$i.log | cut -c1-80; done; done
for i in 1; do for split in 8:8 9:8 9:7 10:7 10:6; do f=${split%:*}; s=${split#*:}
  MOELINK_HTI_FWD_BLOCKS=$f MOELINK_HT_DISPATCH_SEND_BLOCKS=$s n21 head --reps 20 --no-host-check --json $S/split-f$f-s$s-$i.json > $S/split-f$f-s$s-$i.log 2>&1
  echo "split fwd $f send $s round $i rc=$? at $(el)"; grep -E "^ht " $S/split-f$f-s$s-$i.log | cut -c1-80; done; done
STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem ptr" PROCBENCH_ARGS="--mode all --reps 10 --num-sms 24" T_PROCBENCH=160 BUDGET_S=170 \
  OUT=/tmp/o101p W=/tmp/w101p bash scripts/device/run.sh > $S/procbench.log 2>&1
echo "procbench rc=$? at $(el)"; grep -E "^(ht|ll) " $S/procbench.log | cut -c1-80 | head -12
cp /tmp/o101p/*.json $S/ 2>/dev/null
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 80 $H bench --mode ht --ranks 2 --topology 2x1 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/nic-2x1.json > $S/nic-2x1.log 2>&1
echo "nic 2x1 rc=$? at $(el)"; grep -E "^ht " $S/nic-2x1.log | cut -c1-80
for w in base head; do MOELINK_COMMIT="$(cm $w)" CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $(bin $w) bench --mode ht --ranks 4 --topology 2x2 --transport ptr \
  --num-sms 24 --reps 10 --json $S/n22-ptr-$w.json > $S/n22-ptr-$w.log 2>&1
  echo "2x2 ptr $w rc=$? at $(el)"; grep -E "^ht " $S/n22-ptr-$w.log | cut -c1-80; done
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 70 $H bench --mode ht --ranks 4 --topology 2x2 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/n22-nic.json > $S/n22-nic.log 2>&1
echo "2x2 nic rc=$? at $(el)"; grep -E "^ht " $S/n22-nic.log | cut -c1-80
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call101.tgz s101
