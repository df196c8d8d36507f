#!/usr/bin/env bash
# Call 120 (2 x H200, issue 31): 17ac594 (one-node LL waits acquire by loads) in one call beside DeepEP V1:
# the Python step (host cost beside DeepEP, the Python GPU suite at 2 ranks, DeepEP's own test_intranode.py
# and test_low_latency.py against moelink and against DeepEP).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s120; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=230 BUDGET_S=240 \
  OUT=/tmp/o120p W=/tmp/w120p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A14 "moelink / DeepEP\|== summary" $S/python.log | head -40
cp -r /tmp/w120p/python/. $S/ 2>/dev/null; cp /tmp/o120p/* $S/ 2>/dev/null; rm -f $S/results.tgz
grep -E "Best" $S/deepep-tests.log $S/deepep-baseline.log
grep -E "Dispatch \+ combine bandwidth|Dispatch bandwidth" $S/deepep-tests.log $S/deepep-baseline.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call120.tgz s120
