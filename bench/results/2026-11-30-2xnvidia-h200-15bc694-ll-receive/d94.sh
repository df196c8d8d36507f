#!/usr/bin/env bash
# Call 94 (2 x H200). Issue 31: c93dba6's LL kernels (per-block hand-back, one-round-trip entry, dispatch counts
# and metadata before the rows' flags, combine status word) on the GPUs: LL tests and soaks at 2 ranks and with
# 4 ranks sharing the 2 GPUs, then A/B against 7b09642 (the kernels before) at DeepEP's decode shape, 3 rounds
# alternating, pre-reduced and per expert, the token sweep, and 4 ranks sharing the GPUs.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s94; mkdir -p $S; B=.device/moelink; A=.device/base/moelink
t0=$(date +%s)
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=120 BUDGET_S=160 \
  OUT=/tmp/o94t W=/tmp/w94t bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "test result|passed|failed|FAIL" $S/tests.log | tail -6
cp -r /tmp/w94t/. $S/tests-work/ 2>/dev/null
timeout -k 5 50 .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-prereduced,ll-hook --time-budget-s 30 > $S/soak2.log 2>&1
echo "soak 2 ranks rc=$? at $(( $(date +%s) - t0 )) s"; tail -3 $S/soak2.log
timeout -k 5 40 .device/moelink-stress soak --backend cuda --ranks 4 --families ll,ll-prereduced,ll-hook --time-budget-s 20 > $S/soak4.log 2>&1
echo "soak 4 ranks on 2 GPUs rc=$? at $(( $(date +%s) - t0 )) s"; tail -3 $S/soak4.log
ll() { name=$1; bin=$2; shift 2; timeout -k 5 45 $bin bench --mode ll --reps 30 --ll-trace --json $S/ll-$name.json "$@" > $S/ll-$name.log 2>&1
  echo "== ll $name rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ll |back to back" $S/ll-$name.log | head -8; }
for i in 1 2 3; do ll base-$i $A --ranks 2; ll head-$i $B --ranks 2; done
for i in 1 2; do ll pe-base-$i $A --ranks 2 --ll-per-expert; ll pe-head-$i $B --ranks 2 --ll-per-expert; done
ll sweep-base $A --ranks 2 --ll-tokens 1,16,64,256; ll sweep-head $B --ranks 2 --ll-tokens 1,16,64,256
ll r4-base $A --ranks 4; ll r4-head $B --ranks 4
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call94.tgz s94
