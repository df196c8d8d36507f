# call 183 (1xH200): copy-engine pieces split evenly, as many as leave none under 4 MiB (MOELINK_HT_CE_MIN_PIECE_BYTES), 2 ranks
# sharing the GPU: tests with every piece kept (0) and with the default, a 60 s soak, bench sweeps.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
D=.device
{ nvidia-smi -L; date -u; } > $OUT/log.txt
run() { local name=$1; shift; local t0=$(date +%s); echo "=== $name" >> $OUT/log.txt; "$@" >> $OUT/log.txt 2>&1; echo "$name rc=$? s=$(( $(date +%s) - t0 ))" | tee -a $OUT/log.txt >> $OUT/summary.txt; }
run test_min0 env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=4 MOELINK_HT_CE_MIN_PIECE_BYTES=0 timeout 120 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
run test_default env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=4 timeout 120 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
run soak env MOELINK_HT_CE_PIECES=4 timeout 110 $D/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 2048 --time-budget-s 40 --seed 13
B="$D/moelink bench --mode ht --ranks 2 --topology 1x2 --dtype all --reps 20 --tokens 1,512,2048,4096"
for i in 1 2; do
  run sm_$i timeout 90 $B --json $OUT/sm_$i.json
  run ce4_$i env MOELINK_HT_CE_PIECES=4 timeout 90 $B --json $OUT/ce4_$i.json
  run ce4min0_$i env MOELINK_HT_CE_PIECES=4 MOELINK_HT_CE_MIN_PIECE_BYTES=0 timeout 90 $B --json $OUT/ce4min0_$i.json
done
cat $OUT/summary.txt
grep "soak:" $OUT/log.txt
for n in sm_1 ce4_1 ce4min0_1 sm_2 ce4_2 ce4min0_2; do echo "== $n"; awk "/=== $n\$/{f=1} f" $OUT/log.txt | grep "^ht " | head -12; done
