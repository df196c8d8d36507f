#!/usr/bin/env bash
# Call 133 (2 x H200, a GPU per rank unless said; issue 31), head = 68a3fc0 (per-expert LL combine deals
# rows of recv_x), base = 9515bc6 (the kernels before it).
# 1. GPU tests of the LL families (ll, ll_cuda). 2. LL bench A/B, alternating builds: per-expert at 128
# tokens traced, pre-reduced, a token sweep with skewed routing, 1x4 (two ranks a GPU). 3. Python step:
# the GPU suite, DeepEP's test_low_latency / test_intranode against moelink and DeepEP V1, host cost.
# 4. LL soak (2 ranks; 4 ranks sharing the GPUs).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s133; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll_cuda moelink.test.ll" T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 \
  OUT=/tmp/o133t W=/tmp/w133t bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -h -E "test result|passed|failed|FAILED|panicked" $S/tests.log | head -12
cp -r /tmp/w133t/. $S/tests-w 2>/dev/null; cp /tmp/o133t/summary* $S/ 2>/dev/null
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ll --reps 30 --json $S/$name.json "$@" > $S/$name.log 2>&1
  printf "%-18s rc=%s:" $name $?; grep -E "^ll " $S/$name.log | awk '{printf " %s %s %s %s %s |", $2, $3, $4, $5, $6}'; echo; }
for i in 1 2; do for w in 9515bc6 head; do ll per-$w-$i $w --ranks 2 --ll-trace --ll-per-expert; done; done
for w in 9515bc6 head; do ll pre-$w $w --ranks 2 --ll-trace; done
for w in 9515bc6 head; do ll sweep-$w $w --ranks 2 --ll-per-expert --ll-tokens 1,16,64,256 --routing uniform,skewed; done
for w in 9515bc6 head; do CUDA_DEVICE_MAX_CONNECTIONS=32 ll x4-$w $w --ranks 4 --topology 1x4 --ll-per-expert --ll-trace; done
for f in $S/per-*.json $S/pre-*.json $S/x4-*.json; do python3 scripts/ll-trace-points.py $f > ${f%.json}-points.txt 2>&1; done
grep -h "back to back (DeepEP\|back-to-back combine" $S/per-*-points.txt $S/pre-*-points.txt $S/x4-*-points.txt | cut -c1-300
echo "ll done at $(el)"
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=200 BUDGET_S=210 \
  OUT=/tmp/o133p W=/tmp/w133p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A10 "moelink / DeepEP" $S/python.log | head -12
cp -r /tmp/w133p/python/. $S/ 2>/dev/null; cp /tmp/o133p/summary.txt $S/summary-python.txt 2>/dev/null
grep -E "Best|avg_t" $S/deepep-tests.log $S/deepep-baseline.log 2>/dev/null | head -12
grep -h -E "passed|failed" $S/summary-python.txt | head -8
left=$(( 540 - $(date +%s) + t0 ))
if [ $left -gt 40 ]; then
  timeout -k 5 $(( left / 2 )) .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-hook,ll-prereduced --time-budget-s $(( left / 2 - 10 )) > $S/soak2.log 2>&1
  echo "soak2 rc=$? at $(el)"; tail -3 $S/soak2.log
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 $(( left / 2 - 10 )) .device/moelink-stress soak --backend cuda --ranks 4 --families ll,ll-hook --time-budget-s $(( left / 2 - 25 )) > $S/soak4.log 2>&1
  echo "soak4 rc=$? at $(el)"; tail -3 $S/soak4.log
fi
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call133.tgz s133
