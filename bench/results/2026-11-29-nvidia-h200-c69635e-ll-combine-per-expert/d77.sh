#!/usr/bin/env bash
# Call 77 (1 x H200): c69635e (per-expert LL combine: a round's row loads batched before its stores) against
# 9cdde02 (the same CLI, the kernels before). 1. The LL GPU tests, ranks sharing the GPU. 2. A/B in thread mode,
# 2 ranks on the GPU (1x2), 33 blocks a rank (as under MPS at 50 %), per expert (DeepEP's API) and pre-reduced,
# two rounds alternating, kernel traces. 3. The Python host-cost bench beside DeepEP (told 36 SMs), DeepEP's
# own tests against both, the Python GPU suite: 2 processes under MPS at 50 %. GPU-sharing figures throughout.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/s77
t0=$(date +%s)
NGPU=2 STEPS="tests" TEST_BINS="moelink.test.ll moelink.test.ll_cuda" T_TESTS=150 T_TEST_EACH=120 BUDGET_S=160 \
  OUT=/tmp/o77 W=/tmp/w77 bash scripts/device/run.sh 2>&1 | grep -vE "^test .* ok$" | tail -n 25
cp /tmp/o77/* /tmp/s77/ 2>/dev/null
echo "tests done at $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for which in base head; do
    bin=.device/moelink; [ $which = base ] && bin=.device/base/moelink
    for mode in pe pr; do
      flag=""; [ $mode = pe ] && flag=--ll-per-expert
      name=t33-$mode-$which-$round
      CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_LL_SMS=33 timeout -k 5 60 $bin bench --mode ll --ranks 2 --topology 1x2 \
        --reps 20 --ll-trace $flag --json /tmp/s77/$name.json > /tmp/s77/$name.log 2>&1
      echo "$name rc=$?"; python3 .dv/tracepoints_ll.py /tmp/s77/$name.json 2>&1 | grep -A4 " combine " | cut -c1-400
    done
  done
done
echo "ab done at $(( $(date +%s) - t0 )) s"
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=0 DEEPEP_LL_SMS=36 T_PYTHON=300 BUDGET_S=310 \
  OUT=/tmp/o77p W=/tmp/w77p bash scripts/device/run.sh 2>&1 | tail -n 50
cp -r /tmp/w77p/python/. /tmp/s77/ 2>/dev/null; cp /tmp/o77p/* /tmp/s77/ 2>/dev/null
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call77.tgz s77
