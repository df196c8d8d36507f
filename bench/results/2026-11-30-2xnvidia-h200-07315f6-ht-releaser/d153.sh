#!/usr/bin/env bash
# Call 153 (2 x H200, a GPU per rank; issue 31): the senders' releaser warp (HT_RELEASER, MOELINK_HT_RELEASER=1:
# the last warp of every HT sender block fences and stores the flags for the others) against the per-warp
# fence (MOELINK_HT_RELEASER=0, the default), same binary. 1. moelink.test.ht with the releaser; 2. EP2
# checked, alternated; 3. token sweep + skewed routing; 4. EP4 with two ranks per GPU (GPU-sharing figures);
# 5. the HT soak with the releaser; 6. bench nvlink (the pair rate).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s153; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
MOELINK_HT_RELEASER=1 STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 \
  OUT=/tmp/o153 W=/tmp/w153 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
ht() { name=$1; r=$2; shift 2
  env MOELINK_HT_RELEASER=$r timeout -k 5 120 .device/moelink bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-18s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s %s %s |", $2, $3, $4, $5, $8, $NF}'; echo; }
for i in 1 2 3; do for r in 0 1; do ht real-r$r-$i $r --ranks 2; done; done
echo "bench done at $(el)"
for r in 0 1; do ht sweep-r$r $r --ranks 2 --tokens 512,1024,2048 --routing uniform,skewed; done
for r in 0 1; do CUDA_DEVICE_MAX_CONNECTIONS=32 ht ep4-r$r $r --ranks 4 --topology 1x4; done
echo "sweeps done at $(el)"
MOELINK_HT_RELEASER=1 timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 30 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
timeout -k 5 60 .device/moelink bench nvlink --no-jit --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -iE "pair|GB/s" $S/nvlink.log | head -8
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call153.tgz s153
