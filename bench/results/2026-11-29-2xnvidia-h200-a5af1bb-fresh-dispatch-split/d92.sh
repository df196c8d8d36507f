#!/usr/bin/env bash
# Call 92 (2 x H200): where a fresh HT dispatch's time goes beyond the cached one's, at DeepEP's shapes, 24 SMs,
# with the kernels of a5af1bb (binary built at 7b09642, the same HT kernels): MOELINK_HT_TRACE role spans of
# fresh and cached dispatches, one node at EP2 (with and without the per-expert checks, timing experiment 4)
# and 2x1 over ptr (thread mode, a GPU per rank: notify's stamps and the gap before the dispatch).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=7b09642 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s92; mkdir -p $S; B=.device/base/moelink
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
tr() { name=$1; shift; env MOELINK_HT_TRACE=1 "$@" timeout -k 5 60 $B bench --mode ht --dtype all --num-sms 24 --reps 5 --warmup 2 --no-host-check \
  --json $S/$name.json > $S/$name.log 2>&1; echo "== $name rc=$? at $(el)"; grep -E "^ht " $S/$name.log; }
tr ep2
tr ep2-nocheck MOELINK_HT_TIMING_EXPERIMENT=4
MOELINK_HT_TRACE=1 timeout -k 5 60 $B bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 --reps 5 --warmup 2 \
  --no-host-check --json $S/n21.json > $S/n21.log 2>&1; echo "== n21 rc=$? at $(el)"; grep -E "^ht " $S/n21.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call92.tgz s92
