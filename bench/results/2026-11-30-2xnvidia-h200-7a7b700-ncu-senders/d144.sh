#!/usr/bin/env bash
# Call 144 (2 x H200, a GPU per rank; issue 31), head = 7a7b700 (kernels of 9515bc6 + 5931f4f's LL combine).
# Two HT dispatch sender changes from call 143's profile (LG-queue throttling on the senders' stores; the
# destination address waiting on a prefix load), experiment builds alternated with head:
#   metaloop = the meta words stored per destination of the token's mask (a loop over its bits), with
#              st.global, not unrolled over MAX_RANKS with predicates and generic stores;
#   rows     = a chunk's prefix rows loaded in one warp load with the chunk, taken per token by shuffles.
# Cached and fresh dispatch, combine, 24 SMs (checked against the host backend), then senders alone.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s144; mkdir -p $S
t0=$(date +%s)
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo "$(cat .device/COMMIT)+$1";; esac; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 90 $(bin $w) bench --mode ht --ranks 2 --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-16s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s %s |", $2, $3, $4, $8, $NF}'; echo; }
for i in 1 2; do for w in head metaloop rows; do ht real-$w-$i $w; done; done
for w in head metaloop rows; do MOELINK_HT_TIMING_EXPERIMENT=5 ht send-$w $w --no-host-check; done
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call144.tgz s144
