#!/usr/bin/env bash
# Call 93 (2 x H200): 7b8f09a's LL combine (two receive items in flight per warp) in DeepEP's API mode: dispatch
# without weights, so combine sends every expert's row home (--ll-per-expert, 8 rows per item at top-8), against
# 7b09642, 3 rounds alternating. (Call 90 timed the pre-reduced mode, 2 partials per item at EP2.)
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s93; mkdir -p $S
t0=$(date +%s)
ll() { name=$1; bin=$2; c=$3; MOELINK_COMMIT=$c timeout -k 5 45 $bin bench --mode ll --ranks 2 --reps 30 --ll-trace --ll-per-expert --json $S/ll-$name.json > $S/ll-$name.log 2>&1
  echo "== ll $name rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ll " $S/ll-$name.log | head -3; }
for i in 1 2 3; do ll base-$i .device/base/moelink 7b09642; ll items-$i .device/exp/moelink 7b8f09a; done
tar -C /tmp -czf $OUT/call93.tgz s93
