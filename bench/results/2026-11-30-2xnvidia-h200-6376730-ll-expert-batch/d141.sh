#!/usr/bin/env bash
# Call 141 (2 x H200, a GPU per rank; x4 runs: two ranks a GPU; issue 31), head = 6376730 (kernels of 9515bc6).
# The per-expert LL combine's items per round x rows per batch (head: 2 x 6 at two ranks, 3 x 4 above),
# experiment builds pe<I>x<R> = head with combine_rows<I, R> for the per-expert mode, alternated with head.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s141; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo "$(cat .device/COMMIT)+$1";; esac; }
nvidia-smi -L > $S/gpus.txt
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ll --reps 30 --ll-trace --ll-per-expert --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  python3 scripts/ll-trace-points.py $S/$name.json > $S/$name-points.txt 2>&1
  printf "%-14s rc=%s:" $name $rc; grep -h "back-to-back combine" $S/$name-points.txt | grep -o "span [0-9.]* us\|send_issued=[^ ]*\|send_stored=[^ ]*" | tr '\n' ' '; echo; }
for i in 1 2; do for w in head pe1x8 pe2x8 pe3x4 pe4x4; do ll $w-$i $w --ranks 2; done; done
echo "ep2 done at $(el)"
for w in head pe1x8 pe2x8 pe4x4; do CUDA_DEVICE_MAX_CONNECTIONS=32 ll x4-$w $w --ranks 4 --topology 1x4; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call141.tgz s141
