#!/usr/bin/env bash
# Call 132 (2 x H200, a GPU per rank; issue 31), head = afb3bbb (one-node kernels of d40541a).
# Issue 31's ratios in one call: 1. bench nvlink (the pair copy rate). 2. the Rust HT bench at EP2, 24 SMs.
# 3. LL at EP2, pre-reduced and per expert (DeepEP's API mode), traced. 4. DeepEP's test_intranode /
# test_low_latency against moelink and against DeepEP V1, and the host-cost bench (Python step).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s132; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
timeout -k 5 60 .device/moelink bench nvlink --no-jit --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -E "pair sm-stores" $S/nvlink.log
timeout -k 5 120 .device/moelink bench --mode ht --ranks 2 --reps 30 --json $S/ht.json > $S/ht.log 2>&1
printf "ht rc=%s:" $?; grep -E "^ht " $S/ht.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo
for m in pre per; do
  extra=; [ $m = per ] && extra=--ll-per-expert
  timeout -k 5 60 .device/moelink bench --mode ll --ranks 2 --reps 30 --ll-trace $extra --json $S/ll-$m.json > $S/ll-$m.log 2>&1
  printf "ll-%s rc=%s:" $m $?; grep -E "^ll " $S/ll-$m.log | awk '{printf " %s %s %s %s |", $2, $3, $4, $5}'; echo
  python3 scripts/ll-trace-points.py $S/ll-$m.json > $S/ll-$m-points.txt 2>&1; grep "back to back (DeepEP" $S/ll-$m-points.txt | head -2
done
echo "ll done at $(el)"
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=230 BUDGET_S=240 \
  OUT=/tmp/o132p W=/tmp/w132p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A10 "moelink / DeepEP" $S/python.log | head -12
cp -r /tmp/w132p/python/. $S/ 2>/dev/null; cp /tmp/o132p/* $S/ 2>/dev/null; rm -f $S/results.tgz
grep -E "Best" $S/deepep-tests.log $S/deepep-baseline.log
grep -E "Dispatch \+ combine bandwidth" $S/deepep-tests.log $S/deepep-baseline.log
grep -h -E "passed|failed" $S/summary.txt | head -8
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call132.tgz s132
