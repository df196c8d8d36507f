#!/usr/bin/env bash
# Call 165 (2 x H200, a GPU per rank; issue 29): head = the dispatch messages on 64 bytes over the emulated NIC only
# (whole lines where messages are written in place: ptr, NVSHMEM), every chunk in forwarder units over a NIC;
# base = ddd1507 (.device/exp/moelink-base).
# 1. ht_internode + internode_gpu tests (head). 2. 2x1 over emu-nic at 50 GB/s, head checked, then base / head
# alternated 2 rounds, then both traced (FP8). 3. 2x1 over ptr, 2 rounds. 4. NVSHMEM processes 2x1.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s165; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo ddd1507;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 OUT=/tmp/o165 W=/tmp/w165 \
  bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests.log | head -5
b() { name=$1; w=$2; tr=$3; shift 3
  timeout -k 5 150 env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit165-$w "$@" $(bin $w) bench --mode ht --json $S/$name.json $BARGS --transport $tr > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10" b nic-head-checked head $NIC
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
for i in 1 2; do for w in base head; do b nic-$w-$i $w $NIC; done; done
BARGS="--ranks 2 --topology 2x1 --dtype fp8 --reps 10 --no-host-check"
for w in base head; do b nic-$w-traced $w $NIC MOELINK_HT_TRACE=1; done
echo "nic done at $(el)"
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
for i in 1 2; do for w in base head; do b ptr-$w-$i $w ptr; done; done
echo "ptr done at $(el)"
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
for w in base head; do
  chk=--no-host-check; [ $w = head ] && chk=
  mkdir -p /tmp/pb && cp $(bin $w) /tmp/pb/moelink-$w && chmod +x /tmp/pb/moelink-$w
  env NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1 \
    MOELINK_COMMIT=$(cm $w) LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MOELINK_CACHE_DIR=/tmp/moelink-jit-$w \
    timeout -k 5 100 torchrun --standalone --nproc_per_node=2 --no-python /tmp/pb/moelink-$w bench --process --backend cuda --ranks 2 --topology 2x1 \
    --transport nvshmem --mode ht --reps 10 $chk --json $S/procbench-nvshmem-$w.json > $S/procbench-$w.log 2>&1
  printf "%-18s rc=%s:" procbench-$w $?; grep -E "^ht " $S/procbench-$w.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo
done
echo "nvshmem done at $(el)"
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call165.tgz s165
