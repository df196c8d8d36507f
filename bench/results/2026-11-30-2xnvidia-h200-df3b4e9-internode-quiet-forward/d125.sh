#!/usr/bin/env bash
# Call 125 (2 x H200, a GPU per rank; issue 29): the internode HT dispatch.
#   263da79 = the hti kernels of fffbd96 (the session's start); 5628e9f = the emulated NIC's quiet loads every
#   QP together + an FP8 forwarder loads a message's row with its header; head = be3734e: the call's first
#   chunk is staged a token per sender warp.
# 1. ht_internode + internode_gpu tests; HT soak 2x2 over the reordering emulated NIC; HT kill-a-rank.
# 2. 2x1 over emu-nic at 50 GB/s (16 NIC blocks): 263da79 / 5628e9f / head, 2 rounds alternating; head checked.
# 3. 2x1 over ptr: 5628e9f / head, 2 rounds. 4. head traced over emu-nic (FP8). 5. 2x2 (GPU-sharing) 5628e9f / head.
# 6. NVSHMEM processes 2x1, HT: 263da79 / head.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s125; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=200 T_TEST_EACH=190 BUDGET_S=210 OUT=/tmp/o125 W=/tmp/w125 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
timeout -k 5 100 .device/moelink-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
  --families ht,ht-cached --time-budget-s 40 --hidden 2048,7168 --json $S/htsoak.json > $S/soak.log 2>&1
echo "soak rc=$? at $(el)"; tail -n 2 $S/soak.log
b() { name=$1; w=$2; tr=$3; shift 3
  timeout -k 5 150 env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit125-$w "$@" $(bin $w) bench --mode ht --json $S/$name.json $BARGS --transport $tr > $S/$name.log 2>&1
  printf "%-18s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10" b nic-head-checked head $NIC
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
for i in 1 2; do for w in 263da79 5628e9f head; do b nic-$w-$i $w $NIC; done; done
echo "nic done at $(el)"
for i in 1 2; do for w in 5628e9f head; do b ptr-$w-$i $w ptr; done; done
echo "ptr done at $(el)"
BARGS="--ranks 2 --topology 2x1 --dtype fp8 --reps 3 --no-host-check" b nic-head-traced head $NIC MOELINK_HT_TRACE=1
BARGS="--ranks 4 --topology 2x2 --dtype all --reps 5 --no-host-check"
for w in 5628e9f head; do b nic2x2-$w $w $NIC; b ptr2x2-$w $w ptr; done
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
for w in 263da79 head; do
  mkdir -p /tmp/pb && cp $(bin $w) /tmp/pb/moelink-$w && chmod +x /tmp/pb/moelink-$w
  env NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1 \
    MOELINK_COMMIT=$(cm $w) LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MOELINK_CACHE_DIR=/tmp/moelink-jit-$w \
    timeout -k 5 100 torchrun --standalone --nproc_per_node=2 --no-python /tmp/pb/moelink-$w bench --process --backend cuda --ranks 2 --topology 2x1 \
    --transport nvshmem --mode ht --reps 10 --json $S/procbench-nvshmem-$w.json > $S/procbench-$w.log 2>&1
  printf "%-18s rc=%s:" procbench-$w $?; grep -E "^ht " $S/procbench-$w.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo
done
echo "procbench done at $(el)"
STEPS=internode INTERNODE_STEPS="htchaos" T_INTERNODE=200 BUDGET_S=200 OUT=/tmp/o125c W=/tmp/w125c bash scripts/device/run.sh > $S/htchaos.log 2>&1
echo "htchaos rc=$? at $(el)"; grep -iE "chaos|pass|fail" /tmp/o125c/summary.txt | head -8; cp /tmp/o125c/summary.txt $S/htchaos-summary.txt 2>/dev/null
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call125.tgz s125
