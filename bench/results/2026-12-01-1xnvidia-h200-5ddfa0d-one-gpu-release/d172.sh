#!/usr/bin/env bash
# Call 172 (1 x H200): call 171's intranode HT tests skipped their CUDA cases (run.sh gave them one rank a
# GPU); again at 4 and 8 ranks sharing the GPU, head = 5ddfa0d, with the defaults (own fences on one GPU) and
# with the releaser forced (MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2).
set -u
cd "$(dirname "$0")/.."
S=/tmp/s172; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
tests() { name=$1; shift
  env "$@" STEPS="tests" TEST_BINS="moelink.test.ht" T_TESTS=200 T_TEST_EACH=140 BUDGET_S=210 OUT=/tmp/o172-$name W=/tmp/w172-$name \
    bash scripts/device/run.sh > $S/tests-$name.log 2>&1
  echo "tests-$name rc=$? at $(el): $(grep -E 'test result' $S/tests-$name.log | awk '{p+=$4; f+=$6} END {print p" passed, "f" failed"}'), $(grep -c 'skipping cuda' $S/tests-$name.log) cuda skips"
  grep -E "FAILED|panicked" $S/tests-$name.log | head -5; }
for r in 8 4; do
  tests default-$r MOELINK_TEST_RANKS_INTRANODE=$r
  tests releaser-$r MOELINK_TEST_RANKS_INTRANODE=$r MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2
done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call172.tgz s172
