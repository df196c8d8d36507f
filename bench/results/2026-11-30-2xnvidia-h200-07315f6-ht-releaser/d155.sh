#!/usr/bin/env bash
# Call 155 (2 x H200, a GPU per rank; issue 31): head = 07315f6 (the releaser warp by default for the BF16
# dispatch and the combine, release batches of 2; the FP8 dispatch unchanged) against the old defaults in
# the same binary (MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4: the kernels of 7e2d94b), and the combine
# with its releaser as a 13th warp (.device/exp/moelink-rel13 = 8f2e9d3 + rel13.patch, RELEASER=1 BATCH=2).
# 1. moelink.test.ht (head defaults); 2. EP2 alternated; 3. token sweep + skewed; 4. EP4 with two ranks per
# GPU; 5. HT soak (head defaults); 6. bench nvlink; 7. Python step: DeepEP's test_intranode / test_low_latency
# against moelink and DeepEP V1, the GPU suite, host cost.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s155; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 \
  OUT=/tmp/o155 W=/tmp/w155 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
ht() { name=$1; cfg=$2; shift 2
  case $cfg in
    old) envs="MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4"; B=.device/moelink; C=$(cat .device/COMMIT);;
    head) envs=""; B=.device/moelink; C=$(cat .device/COMMIT);;
    rel13) envs="MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2"; B=.device/exp/moelink-rel13; C=8f2e9d3+rel13;;
  esac
  env MOELINK_COMMIT=$C $envs timeout -k 5 120 $B bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-18s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s/%s |", $2, $3, (NF==11 ? $4"-"$5 : ""), $(NF-5), $(NF-1)}'; echo; }
for i in 1 2 3; do for c in old head rel13; do ht real-$c-$i $c --ranks 2; done; done
echo "bench done at $(el)"
for c in old head rel13; do ht sweep-$c $c --ranks 2 --tokens 512,1024,2048 --routing uniform,skewed; done
for c in old head; do CUDA_DEVICE_MAX_CONNECTIONS=32 ht ep4-$c $c --ranks 4 --topology 1x4; done
echo "sweeps done at $(el)"
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 25 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
timeout -k 5 60 .device/moelink bench nvlink --no-jit --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -E "pair sm-stores +24|pair tma +24" $S/nvlink.log
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=220 BUDGET_S=230 \
  OUT=/tmp/o155p W=/tmp/w155p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A10 "moelink / DeepEP" $S/python.log | head -12
cp -r /tmp/w155p/python/. $S/ 2>/dev/null
grep -E "Best|avg_t" $S/deepep-tests.log $S/deepep-baseline.log 2>/dev/null | cut -c1-200 | head -14
grep -h -E "rc=" $S/summary.txt 2>/dev/null | cut -c1-110 | head -8
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call155.tgz s155
