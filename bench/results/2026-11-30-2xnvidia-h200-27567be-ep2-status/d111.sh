#!/usr/bin/env bash
# Call 111 (2 x H200): 27567be's diag_gpu test nvlink_bandwidth_is_measured_and_verified alone (call 110's run of
# the whole binary spent its 110 s in jit_timings_cold_then_cached), at 2 ranks.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s111; mkdir -p $S
(cd crates/moelink && MOELINK_TEST_RANKS=2 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 10 150 ../../.device/tests/moelink.test.diag_gpu \
  nvlink_bandwidth_is_measured_and_verified --include-ignored --test-threads=1 --nocapture) > $S/diag-nvlink.log 2>&1
echo "rc=$?"; grep -vE "^$" $S/diag-nvlink.log | tail -20
tar -C /tmp -czf $OUT/call111.tgz s111
