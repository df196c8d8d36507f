#!/usr/bin/env bash
# Call 89 (2 x H200): the final kernels (93eabf1's; wheel built at 2ad4f02, docs only since) through the Python
# API beside DeepEP V1: the host-cost bench, DeepEP's own test_intranode.py and test_low_latency.py against both
# systems, the Python GPU suite at 2 ranks.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=2ad4f02 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s89; mkdir -p $S
t0=$(date +%s)
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=280 BUDGET_S=290 \
  OUT=/tmp/o89p W=/tmp/w89p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(( $(date +%s) - t0 )) s"; grep -A14 "moelink / DeepEP\|== summary" $S/python.log | head -40
cp -r /tmp/w89p/python/. $S/ 2>/dev/null; cp /tmp/o89p/* $S/ 2>/dev/null; rm -f $S/results.tgz
grep -E "Best" $S/deepep-tests.log $S/deepep-baseline.log
grep -E "Dispatch \+ combine bandwidth|Dispatch bandwidth" $S/deepep-tests.log $S/deepep-baseline.log
tar -C /tmp -czf $OUT/call89.tgz s89
