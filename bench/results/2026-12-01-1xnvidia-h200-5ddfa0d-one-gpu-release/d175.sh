#!/usr/bin/env bash
# Call 175 (1 x H200): every carried test executable through run.sh's tests step with its new default, 8
# ranks sharing the GPU (MOELINK_TEST_RANKS_INTRANODE), code of 5ddfa0d (test executables built at a211fff,
# whose crates are 5ddfa0d's).
set -u
cd "$(dirname "$0")/.."
S=/tmp/s175; mkdir -p $S
STEPS="tests" T_TESTS=540 T_TEST_EACH=200 BUDGET_S=560 OUT=/tmp/o175 W=/tmp/w175 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$?"
awk '/^--- /{name=$2} /^test result:/{print name": "$0} /timed out after/{print}' $S/tests.log
echo "cuda skips: $(grep -c 'skipping' $S/tests.log)"; grep -E "skipping" $S/tests.log | sed 's/.*skipping/skipping/' | sort | uniq -c | head -20
grep -E "FAILED|panicked" $S/tests.log | head -10
tar -C /tmp -czf $OUT/call175.tgz s175
