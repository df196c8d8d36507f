#!/usr/bin/env bash
# Call 98 (2 x H200). Issue 31: 15bc694's LL kernels (per-block hand-back, one-round-trip entry, the dispatch
# receive waiting first then one round trip, the combine's status word): LL tests and soaks at 2 ranks and with 4
# ranks sharing the 2 GPUs; A/B at DeepEP's decode shape against 7b09642 (base) and c93dba6 (exp), 3 rounds
# alternating; per expert; the token sweep; the Python API beside DeepEP (DeepEP's own tests, host cost).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s98; mkdir -p $S; B=.device/moelink; A=.device/base/moelink; X=.device/exp/moelink
t0=$(date +%s)
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=120 BUDGET_S=160 \
  OUT=/tmp/o98t W=/tmp/w98t bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "test result|passed|failed|FAIL" $S/tests.log | tail -4
cp -r /tmp/w98t/. $S/tests-work/ 2>/dev/null
timeout -k 5 45 .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-prereduced,ll-hook --time-budget-s 25 > $S/soak2.log 2>&1
echo "soak 2 ranks rc=$? at $(( $(date +%s) - t0 )) s"; tail -1 $S/soak2.log
CUDA_DEVICE_MAX_CONNECTIONS=16 timeout -k 5 40 .device/moelink-stress soak --backend cuda --ranks 4 --families ll,ll-prereduced,ll-hook --time-budget-s 20 > $S/soak4.log 2>&1
echo "soak 4 ranks on 2 GPUs rc=$? at $(( $(date +%s) - t0 )) s"; tail -1 $S/soak4.log
ll() { name=$1; bin=$2; shift 2; timeout -k 5 45 $bin bench --mode ll --reps 30 --ll-trace --json $S/ll-$name.json "$@" > $S/ll-$name.log 2>&1
  echo "== ll $name rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ll " $S/ll-$name.log | head -8; }
for i in 1 2 3; do ll base-$i $A --ranks 2; ll exp-$i $X --ranks 2; ll head-$i $B --ranks 2; done
ll pe-base $A --ranks 2 --ll-per-expert; ll pe-head $B --ranks 2 --ll-per-expert
ll sweep-base $A --ranks 2 --ll-tokens 1,16,64,256; ll sweep-head $B --ranks 2 --ll-tokens 1,16,64,256
echo "bench done at $(( $(date +%s) - t0 )) s"
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=200 BUDGET_S=210 \
  OUT=/tmp/o98p W=/tmp/w98p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(( $(date +%s) - t0 )) s"; grep -A10 "moelink / DeepEP" $S/python.log | head -12
mkdir -p $S/py; cp -r /tmp/w98p/python/. $S/py/ 2>/dev/null; cp /tmp/o98p/* $S/py/ 2>/dev/null; rm -f $S/py/results.tgz
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call98.tgz s98
