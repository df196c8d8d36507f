# call 180 (1xH200): ec1a3be's copy-engine path (MOELINK_HT_CE_PIECES=4), 2 ranks sharing the GPU: the ht tests,
# a 60 s soak, one bench pair.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
D=.device
{ nvidia-smi -L; date -u; } > $OUT/log.txt
run() { local name=$1; shift; local t0=$(date +%s); echo "=== $name" >> $OUT/log.txt; "$@" >> $OUT/log.txt 2>&1; echo "$name rc=$? s=$(( $(date +%s) - t0 ))" | tee -a $OUT/log.txt >> $OUT/summary.txt; }
run test_ce4 env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=4 timeout 120 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
run soak_ce4 env MOELINK_HT_CE_PIECES=4 timeout 110 $D/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 60 --seed 11
B="$D/moelink bench --mode ht --ranks 2 --topology 1x2 --dtype all --reps 20"
run sm timeout 60 $B
run ce4 env MOELINK_HT_CE_PIECES=4 timeout 60 $B
cat $OUT/summary.txt
grep "mismatch\|soak:" $OUT/log.txt | tail -4
grep -A5 "^mode" $OUT/log.txt | grep "^ht" | head -20
