#!/usr/bin/env bash
# Call 148 (2 x H200, a GPU per rank; issues 31 and the drop-in), head = 5a49065 (the HT kernels of 7867f0f:
# the dispatch's meta words per destination, the combine senders' registers per other rank).
# 1. bench nvlink (pair copy rate); 2. the Rust HT bench at EP2, checked; 3. Python step: the GPU suite,
# DeepEP's test_intranode / test_low_latency against moelink and DeepEP V1 (baseline wheel), host cost.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s148; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
timeout -k 5 60 .device/moelink bench nvlink --no-jit --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -E "pair sm-stores +24|pair tma +24" $S/nvlink.log
timeout -k 5 90 .device/moelink bench --mode ht --ranks 2 --reps 20 --json $S/ht.json > $S/ht.log 2>&1
printf "ht rc=%s:" $?; grep -E "^ht " $S/ht.log | awk '{printf " %s %s %s %s %s |", $2, $3, $4, $8, $NF}'; echo
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=220 BUDGET_S=230 \
  OUT=/tmp/o148p W=/tmp/w148p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A10 "moelink / DeepEP" $S/python.log | head -12
cp -r /tmp/w148p/python/. $S/ 2>/dev/null
grep -E "Best|avg_t" $S/deepep-tests.log $S/deepep-baseline.log 2>/dev/null | cut -c1-200 | head -14
grep -h -E "rc=" $S/summary.txt 2>/dev/null | cut -c1-110 | head -8
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call148.tgz s148
