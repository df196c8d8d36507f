#!/usr/bin/env bash
# Call 171 (1 x H200, every rank sharing it: only a 1-GPU machine was lent). head = 5ddfa0d (the forwarders'
# cut as a template argument, 9b4ca4a; the senders' own fences in batches of 4 where the node's ranks share
# one GPU, 5ddfa0d); base = 79d1a29 (.device/exp/moelink-79d1a29).
# 1. Tests (head): ht with the defaults (now own fences on one GPU) and with the releaser forced
#    (MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2), ht_internode, internode_gpu.
# 2. HT bench base / head alternated: EP4 as 1x4, 3 rounds; EP2 as 1x2, 3 rounds; EP4 at 1024,2048 tokens once.
# 3. 2x1 over emu-nic and ptr (both ranks on the GPU), base / head, 2 rounds / 1 round: the template patch.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s171; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
tests() { name=$1; shift
  env "$@" STEPS="tests" TEST_BINS="$TB" T_TESTS=200 T_TEST_EACH=140 BUDGET_S=210 OUT=/tmp/o171-$name W=/tmp/w171-$name \
    bash scripts/device/run.sh > $S/tests-$name.log 2>&1
  echo "tests-$name rc=$? at $(el): $(grep -E 'test result' $S/tests-$name.log | awk '{p+=$4; f+=$6} END {print p" passed, "f" failed"}')"
  grep -E "FAILED|panicked" $S/tests-$name.log | head -5; }
TB="moelink.test.ht moelink.test.ht_internode moelink.test.internode_gpu" tests default
TB="moelink.test.ht" tests releaser MOELINK_HT_RELEASER=1 MOELINK_HT_RELEASE_BATCH=2
b() { name=$1; w=$2; shift 2
  timeout -k 5 150 env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit171-$w "$@" $(bin $w) bench --mode ht --json $S/$name.json $BARGS > $S/$name.log 2>&1
  printf "%-18s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
BARGS="--ranks 4 --topology 1x4 --reps 20"
for i in 1 2 3; do for w in 79d1a29 head; do b ep4-$w-$i $w; done; done
echo "ep4 done at $(el)"
BARGS="--ranks 2 --topology 1x2 --reps 20"
for i in 1 2 3; do for w in 79d1a29 head; do b ep2-$w-$i $w; done; done
echo "ep2 done at $(el)"
BARGS="--ranks 4 --topology 1x4 --reps 20 --tokens 1024,2048"
for w in 79d1a29 head; do b ep4-sweep-$w $w; done
echo "sweep done at $(el)"
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
for i in 1 2; do for w in 79d1a29 head; do
  chk=--no-host-check; [ $w = head ] && [ $i = 1 ] && chk=
  BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 $chk --transport $NIC" b nic-$w-$i $w
done; done
for w in 79d1a29 head; do BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --transport ptr" b ptr-$w $w; done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call171.tgz s171
