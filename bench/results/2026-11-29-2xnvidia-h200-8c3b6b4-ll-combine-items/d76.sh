#!/usr/bin/env bash
# Call 76 (2 x H200): 8c3b6b4 (LL combine, 2 items x 6 rows at 2 ranks) against e400ca4 (3 x 4). First the LL
# GPU tests at 2 ranks (shared test body against the host backend; graph replays; silent peers), then the A/B
# at EP2 (3 rounds, alternating), then one round each at 4 ranks on the 2 GPUs (1x4, which keeps 3 x 4).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT)
STEPS="tests ab" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=120 \
  AB_ROUNDS=3 AB_ARGS="--mode ll --ranks 2 --reps 30 --ll-trace" BUDGET_S=260 OUT=/tmp/o76 W=/tmp/w76 \
  bash scripts/device/run.sh 2>&1 | grep -vE "^test .* ok$" | tail -n 45
mkdir -p /tmp/s76 && cp /tmp/o76/* /tmp/s76/ 2>/dev/null
for which in base head; do
    bin=.device/moelink; [ $which = base ] && bin=.device/base/moelink
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 60 $bin bench --mode ll --ranks 4 --topology 1x4 --reps 20 --ll-trace \
        --json /tmp/s76/ep4-$which.json > /tmp/s76/ep4-$which.log 2>&1
    echo "ep4 $which rc=$?"; grep -E "^ll " /tmp/s76/ep4-$which.log
done
tar -C /tmp -czf $OUT/call76.tgz s76
