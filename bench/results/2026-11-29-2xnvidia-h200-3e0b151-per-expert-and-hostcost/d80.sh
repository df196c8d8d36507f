#!/usr/bin/env bash
# Call 80 (2 x H200, a GPU per rank): 3e0b151 (per-expert LL combine rows batched, c69635e and 9fe2b78) against
# the same CLI built with 9cdde02's two combine kernels. 1. The LL GPU tests at 2 ranks. 2. A/B: LL at EP2,
# both combine modes, two rounds, kernel traces; 2x1 over ptr (NVLink standing in for RDMA), per expert.
# 3. The Python host-cost bench beside DeepEP with a repeat, DeepEP's own tests against both, the GPU suite.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/s80
t0=$(date +%s)
STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" T_TESTS=150 T_TEST_EACH=120 \
  BUDGET_S=160 OUT=/tmp/o80 W=/tmp/w80 bash scripts/device/run.sh 2>&1 | grep -vE "^test .* ok$" | tail -n 12
cp /tmp/o80/* /tmp/s80/ 2>/dev/null
echo "tests done at $(( $(date +%s) - t0 )) s"
bench() {  # name which mode [bench args]
  local name=$1 which=$2 mode=$3; shift 3
  local bin=.device/moelink commit=$MOELINK_COMMIT
  [ $which = base ] && bin=.device/base/moelink && commit="9cdde02-kernels"
  local flag=""; [ $mode = pe ] && flag=--ll-per-expert
  MOELINK_COMMIT=$commit timeout -k 5 60 $bin bench --mode ll --ranks 2 --reps 30 --ll-trace $flag "$@" \
    --json /tmp/s80/$name.json > /tmp/s80/$name.log 2>&1
  echo "$name rc=$?"; python3 .dv/tracepoints_ll.py /tmp/s80/$name.json 2>&1 | grep -A4 " combine " | grep -v "kernel_trace\|loop_dispatch" | cut -c1-300
}
for round in 1 2; do
  for which in base head; do for mode in pe pr; do bench ep2-$mode-$which-$round $which $mode; done; done
done
for which in base head; do bench n2x1-pe-$which $which pe --topology 2x1; done
echo "ab done at $(( $(date +%s) - t0 )) s"
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=0 T_PYTHON=300 BUDGET_S=310 \
  OUT=/tmp/o80p W=/tmp/w80p bash scripts/device/run.sh 2>&1 | grep -A12 "moelink / DeepEP\|== summary" | head -40
cp -r /tmp/w80p/python/. /tmp/s80/ 2>/dev/null; cp /tmp/o80p/* /tmp/s80/ 2>/dev/null
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call80.tgz s80
