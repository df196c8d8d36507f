#!/usr/bin/env bash
# Call 131 (2 x H200; issue 29). head = 2104408 (8b52360's kernels: the internode notify's messages before its
# prefixes, READY before its quiet; the trace's host points); prev = 10504fe.
# 1. Traced fresh FP8 / BF16 over emu-nic and ptr (2x1): the host's part of the gap after notify.
# 2. 2x2 (two ranks on each H200: GPU-sharing) over emu-nic and ptr, prev / head, 2 rounds.
# 3. HT soak 2x2 over the reordering emulated NIC (twice: the first compiles). 4. HT kill-a-rank (htchaos).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s131; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
b() { name=$1; w=$2; tr=$3; shift 3
  timeout -k 5 150 env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit131-$w "$@" $(bin $w) bench --mode ht --json $S/$name.json $BARGS --transport $tr > $S/$name.log 2>&1
  printf "%-18s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BARGS="--ranks 2 --topology 2x1 --dtype all --reps 5 --no-host-check"
b nic-head-traced head $NIC MOELINK_HT_TRACE=1; b ptr-head-traced head ptr MOELINK_HT_TRACE=1
for f in $S/*-traced.log; do echo "$(basename $f):"; grep "moelink trace" $f | grep " dispatch (moelink" | sed 's/span \([0-9.]*\) us; \([0-9.]*\) us after.*\(host_ready_us[^)]*)\), \(host_launch_us[^)]*)\).*/span \1, gap \2, \3, \4/' | tail -6; done
BARGS="--ranks 4 --topology 2x2 --dtype all --reps 5 --no-host-check"
for i in 1 2; do for w in 10504fe head; do b nic2x2-$w-$i $w $NIC; b ptr2x2-$w-$i $w ptr; done; done
echo "2x2 done at $(el)"
for n in 1 2; do
  timeout -k 5 100 env MOELINK_CACHE_DIR=/tmp/jit131-soak .device/moelink-stress soak --backend cuda --ranks 4 --topology 2x2 --transport emu-nic \
    --families ht,ht-cached --time-budget-s $((n == 1 ? 40 : 25)) --hidden 2048,7168 --json $S/htsoak-$n.json > $S/soak-$n.log 2>&1
  echo "soak $n rc=$? at $(el): $(grep -E '^\[soak\]|^soak:' $S/soak-$n.log | tr '\n' ' ' | cut -c1-300)"
done
STEPS=internode INTERNODE_STEPS="htchaos" T_INTERNODE=200 BUDGET_S=200 OUT=/tmp/o131c W=/tmp/w131c bash scripts/device/run.sh > $S/htchaos.log 2>&1
echo "htchaos rc=$? at $(el)"; grep -iE "chaos|pass|fail" /tmp/o131c/summary.txt | head -8; cp /tmp/o131c/summary.txt $S/htchaos-summary.txt 2>/dev/null
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call131.tgz s131
