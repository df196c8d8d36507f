#!/usr/bin/env bash
# Call 126 (2 x H200; issues 29 and 31), head = be3734e.
# 1. The HT soak (2x2 over the reordering emulated NIC) ran 48 rounds a family in 40 s in call 125 against
#    1,120 in call 124 (df3b4e9): each binary twice, the second run with the JIT cache the first left.
# 2. The Python step beside DeepEP V1 (host cost, the Python GPU suite, DeepEP's own test_intranode.py and
#    test_low_latency.py against moelink and against DeepEP).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s126; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink-stress;; *) echo .device/exp/moelink-stress-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
for w in head 5628e9f; do for n in 1 2; do
  env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit126-$w CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 70 $(bin $w) soak --backend cuda --ranks 4 \
    --topology 2x2 --transport emu-nic --families ht,ht-cached --time-budget-s $((n == 1 ? 35 : 20)) --hidden 2048,7168 \
    --json $S/htsoak-$w-$n.json > $S/htsoak-$w-$n.log 2>&1
  echo "soak $w $n rc=$? at $(el): $(grep -E '^\[soak\]|^soak:' $S/htsoak-$w-$n.log | tr '\n' ' ' | cut -c1-300)"
done; done
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=230 BUDGET_S=240 \
  OUT=/tmp/o126p W=/tmp/w126p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A14 "moelink / DeepEP\|== summary" $S/python.log | head -40
cp -r /tmp/w126p/python/. $S/ 2>/dev/null; cp /tmp/o126p/* $S/ 2>/dev/null; rm -f $S/results.tgz
grep -E "Best" $S/deepep-tests.log $S/deepep-baseline.log
grep -E "Dispatch \+ combine bandwidth|Dispatch bandwidth" $S/deepep-tests.log $S/deepep-baseline.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call126.tgz s126
