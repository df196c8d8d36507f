#!/usr/bin/env bash
# Call 176 (1 x H200): 8a0223a's ht and ht_internode tests at 8 ranks sharing the GPU (release() refactor,
# the RDMA_MAX_QPS static_assert), defaults and the releaser forced.
set -u
cd "$(dirname "$0")/.."
S=/tmp/s176; mkdir -p $S
for w in default releaser; do
  extra=(); [ $w = releaser ] && extra=(MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2)
  env "${extra[@]}" STEPS=tests TEST_BINS="moelink.test.ht moelink.test.ht_internode" T_TESTS=250 BUDGET_S=260 OUT=/tmp/o176-$w W=/tmp/w176-$w \
    bash scripts/device/run.sh > $S/tests-$w.log 2>&1
  echo "tests-$w rc=$?: $(grep -E 'test result' $S/tests-$w.log | awk '{p+=$4; f+=$6} END {print p" passed, "f" failed"}'), $(grep -c skipping $S/tests-$w.log) skips"
  [ $w = releaser ] && break
done
tar -C /tmp -czf $OUT/call176.tgz s176
