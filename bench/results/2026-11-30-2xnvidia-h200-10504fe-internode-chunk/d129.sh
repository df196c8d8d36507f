#!/usr/bin/env bash
# Call 129 (2 x H200, a GPU per rank; issues 29 and 31). head = 10504fe + HTI_MAX_CHUNKS 1024 (uncommitted
# experiment build): the internode HT chunk Q = 8 (default) against Q = 4 (MOELINK_HT_SEND_CHUNK=4), same binary.
# 1. bench nvlink (the peer bandwidth, issue 31's denominator). 2. 2x1 over emu-nic at 50 GB/s, Q 8 / 4 / 16,
# 2 rounds alternating, one checked. 3. 2x1 over ptr, Q 8 / 4, 2 rounds. 4. FP8 traced over emu-nic, Q 8 / 4.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s129; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
timeout -k 5 60 .device/moelink bench nvlink --no-jit --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -E "pair sm-stores|pair tma" $S/nvlink.log
b() { name=$1; q=$2; tr=$3; shift 3
  timeout -k 5 150 env MOELINK_CACHE_DIR=/tmp/jit129 MOELINK_HT_SEND_CHUNK=$q "$@" .device/moelink bench --mode ht --json $S/$name.json $BARGS --transport $tr > $S/$name.log 2>&1
  printf "%-18s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10" b nic-q4-checked 4 $NIC
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
for i in 1 2; do for q in 8 4 16; do b nic-q$q-$i $q $NIC; done; done
echo "nic done at $(el)"
for i in 1 2; do for q in 8 4; do b ptr-q$q-$i $q ptr; done; done
echo "ptr done at $(el)"
BARGS="--ranks 2 --topology 2x1 --dtype fp8 --reps 3 --no-host-check"
for q in 8 4; do b nic-q$q-traced $q $NIC MOELINK_HT_TRACE=1; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call129.tgz s129
