#!/usr/bin/env bash
# Call 90 (2 x H200). Issue 31: 7b8f09a's LL combine (two receive items in flight per warp) on the GPUs: the LL
# tests at 2 ranks, then A/B against 7b09642 at DeepEP's decode shape, 3 rounds alternating; the Python API
# beside DeepEP (host cost, DeepEP's own LL and intranode tests). Issue 29: HT and LL across 2x2 virtual nodes,
# 4 ranks sharing the 2 GPUs (thread mode), over ptr and HT over the emulated NIC at 50 GB/s.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s90; mkdir -p $S; B=.device/moelink; A=.device/base/moelink
t0=$(date +%s)
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" MOELINK_TEST_RANKS=2 T_TESTS=120 T_TEST_EACH=100 BUDGET_S=130 \
  OUT=/tmp/o90t W=/tmp/w90t bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "test result|passed|failed|FAIL" $S/tests.log | tail -6
cp -r /tmp/w90t/. $S/tests-work/ 2>/dev/null
ll() { name=$1; bin=$2; timeout -k 5 45 $bin bench --mode ll --ranks 2 --reps 30 --ll-trace --json $S/ll-$name.json > $S/ll-$name.log 2>&1
  echo "== ll $name rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ll |back to back" $S/ll-$name.log | head -6; }
for i in 1 2 3; do ll base-$i $A; ll head-$i $B; done
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=200 BUDGET_S=210 \
  OUT=/tmp/o90p W=/tmp/w90p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(( $(date +%s) - t0 )) s"; grep -A10 "moelink / DeepEP" $S/python.log | head -12
mkdir -p $S/py; cp -r /tmp/w90p/python/. $S/py/ 2>/dev/null; cp /tmp/o90p/* $S/py/ 2>/dev/null; rm -f $S/py/results.tgz
grep -E "Best|Dispatch \+ combine bandwidth" $S/py/deepep-tests.log $S/py/deepep-baseline.log 2>/dev/null | head -12
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $B bench --mode all --ranks 4 --topology 2x2 --transport ptr --num-sms 24 --reps 10 \
  --json $S/n22-ptr.json > $S/n22-ptr.log 2>&1
echo "2x2 ptr rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^(ht|ll) " $S/n22-ptr.log
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 70 $B bench --mode ht --ranks 4 --topology 2x2 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/n22-nic.json > $S/n22-nic.log 2>&1
echo "2x2 nic rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ht " $S/n22-nic.log
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call90.tgz s90
