#!/usr/bin/env bash
# Call 169 (1 x H200, ranks sharing it; issue 31's "ranks sharing a GPU stay within noise"): the HT releaser
# warp (the default for the BF16 dispatch and the combine since 07315f6) against the senders' own fences in
# batches of 4 (MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4, the kernels before 07315f6), one binary
# (.device/moelink = 79d1a29; its intranode kernels are ddd1507's), alternated 3 rounds: EP4 as 1x4 (four
# ranks on the GPU) and EP2 (two ranks on it), 20 reps, DeepEP's shape; then EP4 at 1024 and 2048 tokens.
# Run twice (the first without CUDA_DEVICE_MAX_CONNECTIONS for EP2, which the bench refused; EP4_ROUNDS="4"
# then "skip").
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s169; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
ht() { name=$1; shift
  env "$@" MOELINK_CACHE_DIR=/tmp/jit169 timeout -k 5 120 .device/moelink bench --mode ht --reps 20 --json $S/$name.json $BARGS > $S/$name.log 2>&1; rc=$?
  printf "%-14s rc=%s:" $name $rc; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
BARGS="--ranks 4 --topology 1x4"
for i in ${EP4_ROUNDS:-1 2 3}; do [ "$i" = skip ] && continue
  ht ep4-fences-$i MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4
  ht ep4-default-$i MOELINK_COMMIT=$MOELINK_COMMIT
done
echo "ep4 done at $(el)"
BARGS="--ranks 2 --topology 1x2"
for i in 1 2 3; do
  ht ep2-fences-$i MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4
  ht ep2-default-$i MOELINK_COMMIT=$MOELINK_COMMIT
done
BARGS="--ranks 4 --topology 1x4 --tokens 1024,2048"
for w in fences default; do
  if [ $w = fences ]; then ht ep4-sweep-$w MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4; else ht ep4-sweep-$w MOELINK_COMMIT=$MOELINK_COMMIT; fi
done
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call169.tgz s169
