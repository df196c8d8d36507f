# call 184 (1xH200): the review commit's copy-engine path, 2 ranks sharing the GPU: ht tests (every piece kept,
# and the default), one bench pair.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
D=.device
{ nvidia-smi -L; date -u; } > $OUT/log.txt
run() { local name=$1; shift; local t0=$(date +%s); echo "=== $name" >> $OUT/log.txt; "$@" >> $OUT/log.txt 2>&1; echo "$name rc=$? s=$(( $(date +%s) - t0 ))" | tee -a $OUT/log.txt >> $OUT/summary.txt; }
run test_min0 env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=4 MOELINK_HT_CE_MIN_PIECE_BYTES=0 timeout 120 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
run test_default env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=4 timeout 120 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
B="$D/moelink bench --mode ht --ranks 2 --topology 1x2 --dtype all --reps 20"
run sm timeout 60 $B
run ce4 env MOELINK_HT_CE_PIECES=4 timeout 60 $B
cat $OUT/summary.txt
grep -A5 "^mode" $OUT/log.txt | grep "^ht"
