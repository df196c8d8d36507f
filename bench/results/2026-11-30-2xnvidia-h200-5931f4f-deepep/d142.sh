#!/usr/bin/env bash
# Call 142 (2 x H200, a GPU per rank; issue 31), head = 5931f4f (the per-expert LL combine at <= 2 ranks takes
# one item and all its rows a round). 1. GPU tests of the LL families. 2. LL per-expert and pre-reduced,
# traced. 3. Python step: the GPU suite, DeepEP's test_low_latency / test_intranode against moelink and
# DeepEP V1, host cost. 4. LL soak (2 ranks).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s142; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll_cuda moelink.test.ll" T_TESTS=120 T_TEST_EACH=110 BUDGET_S=130 \
  OUT=/tmp/o142t W=/tmp/w142t bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -h -E "test result|FAILED|panicked" $S/tests.log | head -6
for m in per pre; do
  extra=; [ $m = per ] && extra=--ll-per-expert
  timeout -k 5 60 .device/moelink bench --mode ll --ranks 2 --reps 30 --ll-trace $extra --json $S/ll-$m.json > $S/ll-$m.log 2>&1
  printf "ll-%s rc=%s:" $m $?; grep -E "^ll " $S/ll-$m.log | awk '{printf " %s %s %s %s |", $2, $3, $4, $NF}'; echo
  python3 scripts/ll-trace-points.py $S/ll-$m.json > $S/ll-$m-points.txt 2>&1; grep "back to back (DeepEP" $S/ll-$m-points.txt | head -2
done
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=200 BUDGET_S=210 \
  OUT=/tmp/o142p W=/tmp/w142p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A10 "moelink / DeepEP" $S/python.log | head -12
cp -r /tmp/w142p/python/. $S/ 2>/dev/null
grep -E "Best|avg_t" $S/deepep-tests.log $S/deepep-baseline.log 2>/dev/null | cut -c1-200 | head -12
grep -h -E "rc=" $S/summary.txt 2>/dev/null | cut -c1-110 | head -8
left=$(( 500 - $(date +%s) + t0 ))
if [ $left -gt 30 ]; then
  timeout -k 5 $left .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-hook --time-budget-s $(( left - 10 )) > $S/soak2.log 2>&1
  echo "soak2 rc=$? at $(el)"; tail -1 $S/soak2.log
fi
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call142.tgz s142
