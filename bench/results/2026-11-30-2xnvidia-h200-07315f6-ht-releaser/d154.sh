#!/usr/bin/env bash
# Call 154 (2 x H200, a GPU per rank; issue 31): the releaser warp again, with the combine's releaser as a 13th
# warp (12 senders as without it; the dispatch's stays one of 16: 17 warps spill) and with release batches of 2
# and 1 (the releaser takes the fences off the senders, so smaller batches cost them nothing). Builds:
# .device/moelink = 8f2e9d3 (call 153's); .device/exp/moelink-rel13 = 8f2e9d3 + rel13.patch. MOELINK_HT_RELEASER=0
# is the default kernels in both. 1. moelink.test.ht (rel13 tree) with the releaser; 2. EP2 alternated; 3. token
# sweep + skewed; 4. EP4 with two ranks per GPU; 5. HT soak with the releaser (rel13).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s154; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
MOELINK_HT_RELEASER=1 STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 \
  OUT=/tmp/o154 W=/tmp/w154 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
B=.device/exp/moelink-rel13
ht() { name=$1; r=$2; rb=$3; shift 3
  env MOELINK_COMMIT=8f2e9d3+rel13 MOELINK_HT_RELEASER=$r MOELINK_HT_RELEASE_BATCH=$rb timeout -k 5 120 $B bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-18s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s/%s |", $2, $3, (NF==11 ? $4"-"$5 : ""), $(NF-5), $(NF-1)}'; echo; }
for i in 1 2; do for c in "0 4" "1 4" "1 2" "1 1"; do set -- $c; ht real-r$1-b$2-$i $1 $2 --ranks 2; done; done
echo "bench done at $(el)"
for c in "0 4" "1 4" "1 2"; do set -- $c; ht sweep-r$1-b$2 $1 $2 --ranks 2 --tokens 512,1024,2048 --routing uniform,skewed; done
for c in "0 4" "1 4" "1 2"; do set -- $c; CUDA_DEVICE_MAX_CONNECTIONS=32 ht ep4-r$1-b$2 $1 $2 --ranks 4 --topology 1x4; done
echo "sweeps done at $(el)"
MOELINK_HT_RELEASER=1 timeout -k 5 60 .device/exp/moelink-stress-rel13 soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 25 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=1 timeout -k 5 60 .device/exp/moelink-stress-rel13 soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 15 --hidden 2048,7168 --json $S/htsoak-b1.json > $S/htsoak-b1.log 2>&1
echo "htsoak-b1 rc=$? at $(el)"; tail -n 2 $S/htsoak-b1.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call154.tgz s154
