#!/usr/bin/env bash
# Call 110 (2 x H200): 27567be's diag_gpu test (bench nvlink's local pattern inside it) at 2 ranks; the HT
# tests and the HT soak with 4 ranks on the 2 GPUs (GPU-sharing: the combine reducers' waits on 3 remote ranks).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s110; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
STEPS="tests" TEST_BINS="moelink.test.diag_gpu" MOELINK_TEST_RANKS=2 T_TESTS=120 T_TEST_EACH=110 BUDGET_S=130 OUT=/tmp/o110a W=/tmp/w110a \
  bash scripts/device/run.sh > $S/tests-diag.log 2>&1
echo "diag tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|Local" $S/tests-diag.log | head -12
(cd crates/moelink && MOELINK_TEST_RANKS=4 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 10 150 ../../.device/tests/moelink.test.ht --include-ignored --test-threads=1) > $S/tests-ht4.log 2>&1
echo "ht tests, 4 ranks rc=$? at $(el)"; grep -E "test result|FAILED|panicked" $S/tests-ht4.log | head -5
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 70 .device/moelink-stress soak --backend cuda --ranks 4 --families ht,ht-cached --t-max 1024 --time-budget-s 40 \
  --json $S/soak4.json > $S/soak4.log 2>&1
echo "soak 4 ranks rc=$? at $(el)"; tail -n 2 $S/soak4.log
cp -r /tmp/w110a/. $S/diag-work 2>/dev/null; cp /tmp/o110a/*.json $S/ 2>/dev/null
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call110.tgz s110
