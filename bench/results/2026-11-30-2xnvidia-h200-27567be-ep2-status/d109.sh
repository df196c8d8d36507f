#!/usr/bin/env bash
# Call 109 (2 x H200, issue 31): 27567be in one call beside DeepEP V1: bench nvlink (pair and local), the Rust
# HT and LL benches at EP2, then the Python step (host cost beside DeepEP, the Python GPU suite at 2 ranks,
# DeepEP's own test_intranode.py and test_low_latency.py against moelink and against DeepEP).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s109; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
timeout -k 5 60 .device/moelink bench nvlink --sms 8,10,24 --method sm --pattern pair,all-to-all,local --no-jit --barrier-iters 100 --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -E "copy " $S/nvlink.log
timeout -k 5 90 .device/moelink bench --mode ht --dtype all --num-sms 24 --reps 20 --json $S/ht.json > $S/ht.log 2>&1
echo "ht rc=$? at $(el)"; grep -E "^ht " $S/ht.log
timeout -k 5 90 .device/moelink bench --mode ll --ranks 2 --reps 30 --ll-trace --json $S/ll.json > $S/ll.log 2>&1
echo "ll rc=$? at $(el)"; grep -E "^ll |back to back" $S/ll.log | head -8
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=300 BUDGET_S=310 \
  OUT=/tmp/o109p W=/tmp/w109p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A14 "moelink / DeepEP\|== summary" $S/python.log | head -40
cp -r /tmp/w109p/python/. $S/ 2>/dev/null; cp /tmp/o109p/* $S/ 2>/dev/null; rm -f $S/results.tgz
grep -E "Best" $S/deepep-tests.log $S/deepep-baseline.log
grep -E "Dispatch \+ combine bandwidth|Dispatch bandwidth" $S/deepep-tests.log $S/deepep-baseline.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call109.tgz s109
