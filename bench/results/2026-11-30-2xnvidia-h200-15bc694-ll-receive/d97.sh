#!/usr/bin/env bash
# Call 97 (2 x H200). Issue 31: the LL waits with one round trip less and the own acquire at GPU scope: LL tests
# and a soak, then own rows before the peers' flags against after them (MOELINK_LL_EXPERIMENT=own_late),
# alternating 3 times, with 7b09642 (base) and c93dba6 (exp) once each.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s97; mkdir -p $S; B=.device/moelink; A=.device/base/moelink; X=.device/exp/moelink
t0=$(date +%s)
nvidia-smi -L > $S/gpus.txt
ll() { name=$1; bin=$2; shift 2; timeout -k 5 45 $bin bench --mode ll --reps 30 --ll-trace --json $S/ll-$name.json "$@" > $S/ll-$name.log 2>&1
  echo "== ll $name rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ll " $S/ll-$name.log | head -8; }
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=120 BUDGET_S=160 \
  OUT=/tmp/o97t W=/tmp/w97t bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "test result|passed|failed|FAIL" $S/tests.log | tail -4
timeout -k 5 40 .device/moelink-stress soak --backend cuda --ranks 2 --families ll,ll-prereduced,ll-hook --time-budget-s 20 > $S/soak2.log 2>&1
echo "soak 2 ranks rc=$? at $(( $(date +%s) - t0 )) s"; tail -1 $S/soak2.log
ll base $A --ranks 2; ll exp $X --ranks 2
for i in 1 2 3; do ll head-$i $B --ranks 2; MOELINK_LL_EXPERIMENT=own_late ll late-$i $B --ranks 2; done
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call97.tgz s97
