#!/usr/bin/env bash
# Call 82 (2 x H200, issue 31): where the HT kernels' time goes at EP2, 24 SMs, DeepEP's shapes; the tuning knobs
# swept at EP2 (never swept there but the sender split); LL references with traces.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s82; mkdir -p $S; B=.device/moelink
t0=$(date +%s)
nvidia-smi -L > $S/gpus.txt
timeout -k 5 60 $B bench nvlink --sms 8,10,12,14,24 --method sm --pattern pair --no-jit --barrier-iters 100 --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(( $(date +%s) - t0 )) s"; grep -iE "pair|GB/s" $S/nvlink.log | head -12
ht() { name=$1; shift; env "$@" timeout -k 5 90 $B bench --mode ht --dtype all --num-sms 24 --reps 20 --no-host-check --json $S/ht-$name.json > $S/ht-$name.log 2>&1
  echo "== $name rc=$? at $(( $(date +%s) - t0 )) s: $*"; grep -E "^ht " $S/ht-$name.log; }
# The reference, checked against the host first.
timeout -k 5 150 $B bench --mode ht --dtype all --num-sms 24 --reps 20 --json $S/ht-base.json > $S/ht-base.log 2>&1
echo "== base (host-checked) rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ht |match" $S/ht-base.log | head -12
MOELINK_HT_TRACE=1 timeout -k 5 90 $B bench --mode ht --dtype all --num-sms 24 --reps 3 --warmup 1 --no-host-check --json $S/ht-trace.json > $S/ht-trace.log 2>&1
echo "== trace rc=$?"; grep "rank 0" $S/ht-trace.log | grep -E "trace" | tail -8
ht exp1 MOELINK_HT_TIMING_EXPERIMENT=1
ht exp2 MOELINK_HT_TIMING_EXPERIMENT=2
ht exp3 MOELINK_HT_TIMING_EXPERIMENT=3
ht rb2 MOELINK_HT_RELEASE_BATCH=2
ht rb8 MOELINK_HT_RELEASE_BATCH=8
ht rb16 MOELINK_HT_RELEASE_BATCH=16
ht sc16 MOELINK_HT_SEND_CHUNK=16
ht dyn0 MOELINK_HT_DYNAMIC_SEND=0
ht rc2 MOELINK_HT_RECV_CHUNK=2
ht rc4 MOELINK_HT_RECV_CHUNK=4
ht base2
echo "ht done at $(( $(date +%s) - t0 )) s"
ll() { name=$1; shift; env "$@" timeout -k 5 60 $B bench --mode ll --ranks 2 --reps 30 --ll-trace --json $S/ll-$name.json > $S/ll-$name.log 2>&1
  echo "== ll $name rc=$? at $(( $(date +%s) - t0 )) s: $*"; grep -E "^ll |back to back" $S/ll-$name.log | head -6; }
ll base
ll noloads MOELINK_LL_EXPERIMENT=no_loads
ll local MOELINK_LL_EXPERIMENT=local_stores
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call82.tgz s82
