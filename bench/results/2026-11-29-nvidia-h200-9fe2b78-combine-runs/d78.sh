#!/usr/bin/env bash
# Call 78 (1 x H200): 9fe2b78 (LL combine send: contiguous chunk runs per warp; the across-nodes per-expert
# rows batched) against b1b1bd4 (c69635e's kernels). 1. The LL GPU tests, one node (2 ranks sharing the GPU)
# and across virtual nodes (8 ranks). 2. A/B in thread mode on the GPU, both combine modes: 1x2 at 33 blocks
# (two rounds), 1x2 at 66 blocks, 2x1 over ptr at 33 blocks; head with no row loads (where the send's time
# goes). 3. The Python host-cost bench beside DeepEP (told 36 SMs), DeepEP's tests, the Python GPU suite, 2
# processes under MPS at 50 %. GPU-sharing figures throughout.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/s78
t0=$(date +%s)
NGPU=2 STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda moelink.test.ll_internode_gpu" T_TESTS=200 T_TEST_EACH=120 \
  BUDGET_S=210 OUT=/tmp/o78 W=/tmp/w78 bash scripts/device/run.sh 2>&1 | grep -vE "^test .* ok$" | tail -n 25
cp /tmp/o78/* /tmp/s78/ 2>/dev/null
echo "tests done at $(( $(date +%s) - t0 )) s"
bench() {  # name sms which mode topology [extra env]
  local name=$1 sms=$2 which=$3 mode=$4 topo=$5; shift 5
  local bin=.device/moelink; [ $which = base ] && bin=.device/base/moelink
  local flag=""; [ $mode = pe ] && flag=--ll-per-expert
  env CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_LL_SMS=$sms "$@" timeout -k 5 60 $bin bench --mode ll --ranks 2 --topology $topo \
    --reps 20 --ll-trace $flag --json /tmp/s78/$name.json > /tmp/s78/$name.log 2>&1
  echo "$name rc=$?"; python3 .dv/tracepoints_ll.py /tmp/s78/$name.json 2>&1 | grep -A4 " combine " | grep -v kernel_trace | cut -c1-300
}
for round in 1 2; do
  for which in base head; do for mode in pe pr; do bench t33-$mode-$which-$round 33 $which $mode 1x2; done; done
done
for which in base head; do for mode in pe pr; do bench t66-$mode-$which 66 $which $mode 1x2; done; done
for which in base head; do for mode in pe pr; do bench n33-$mode-$which 33 $which $mode 2x1; done; done
bench t33-pr-head-noloads 33 head pr 1x2 MOELINK_LL_EXPERIMENT=no_loads
echo "ab done at $(( $(date +%s) - t0 )) s"
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=0 DEEPEP_LL_SMS=36 T_PYTHON=300 BUDGET_S=310 \
  OUT=/tmp/o78p W=/tmp/w78p bash scripts/device/run.sh 2>&1 | grep -A12 "moelink / DeepEP\|== summary" | head -40
cp -r /tmp/w78p/python/. /tmp/s78/ 2>/dev/null; cp /tmp/o78p/* /tmp/s78/ 2>/dev/null
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call78.tgz s78
