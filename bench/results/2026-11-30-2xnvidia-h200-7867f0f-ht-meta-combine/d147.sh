#!/usr/bin/env bash
# Call 147 (2 x H200, a GPU per rank; issue 31): head = ea7c0ec + (a) the dispatch's meta words stored per
# destination (call 144's metaloop) and (b) the combine senders' registers sized for the other ranks only
# (at EP2: 14 vectors a lane in flight in 2 rounds, not 10 in 3). base = 5931f4f's build (ea7c0ec's kernels).
# 1. moelink.test.ht; 2. EP2 checked, alternated; 3. senders alone; 4. token sweep + skewed routing; 5. EP4 with
# two ranks per GPU (GPU-sharing figures); 6. the HT soak; 7. bench nvlink (the pair rate).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s147; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
STEPS="tests" TEST_BINS="moelink.test.ht" MOELINK_TEST_RANKS=2 T_TESTS=150 T_TEST_EACH=140 BUDGET_S=160 \
  OUT=/tmp/o147 W=/tmp/w147 bash scripts/device/run.sh > $S/tests.log 2>&1
echo "tests rc=$? at $(el)"; grep -E "test result|FAILED|panicked|timed out" $S/tests.log | head -8
bin() { case $1 in base) echo .device/exp/moelink-base;; *) echo .device/moelink;; esac; }
cm() { case $1 in base) echo 5931f4f;; *) cat .device/COMMIT;; esac; }
ht() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 120 $(bin $w) bench --mode ht --reps 20 --json $S/$name.json "$@" > $S/$name.log 2>&1; rc=$?
  printf "%-18s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s %s %s %s |", $2, $3, $4, $5, $8, $NF}'; echo; }
for i in 1 2 3; do for w in base head; do ht real-$w-$i $w --ranks 2; done; done
echo "bench done at $(el)"
for w in base head; do MOELINK_HT_TIMING_EXPERIMENT=5 ht send-$w $w --ranks 2 --no-host-check; done
for w in base head; do ht sweep-$w $w --ranks 2 --tokens 512,1024,2048 --routing uniform,skewed; done
for w in base head; do CUDA_DEVICE_MAX_CONNECTIONS=32 ht ep4-$w $w --ranks 4 --topology 1x4; done
echo "sweeps done at $(el)"
timeout -k 5 60 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --time-budget-s 30 --hidden 2048,7168 --json $S/htsoak.json > $S/htsoak.log 2>&1
echo "htsoak rc=$? at $(el)"; tail -n 2 $S/htsoak.log
timeout -k 5 60 .device/moelink bench nvlink --no-jit --json $S/nvlink.json > $S/nvlink.log 2>&1
echo "nvlink rc=$? at $(el)"; grep -iE "pair|GB/s" $S/nvlink.log | head -8
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call147.tgz s147
