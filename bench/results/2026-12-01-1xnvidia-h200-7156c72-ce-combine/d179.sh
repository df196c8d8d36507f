# call 179 (1xH200): the copy-engine cached dispatch and combine (MOELINK_HT_CE_PIECES), 2 ranks sharing the GPU:
# the ht tests, a soak against the host twin, bench A/B against the SM senders.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
D=.device
{ nvidia-smi -L; date -u; } > $OUT/log.txt
run() { local name=$1; shift; local t0=$(date +%s); echo "=== $name" >> $OUT/log.txt; "$@" >> $OUT/log.txt 2>&1; echo "$name rc=$? s=$(( $(date +%s) - t0 ))" | tee -a $OUT/log.txt >> $OUT/summary.txt; }
for p in 4 1; do
  run test_ce$p env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=$p timeout 120 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
done
run test_ce4_r4 env MOELINK_TEST_RANKS=4 MOELINK_HT_CE_PIECES=4 timeout 200 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
run soak_ce4 env MOELINK_HT_CE_PIECES=4 timeout 170 $D/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached --t-max 1024 --time-budget-s 120 --json $OUT/soak_ce4.json
B="$D/moelink bench --mode ht --ranks 2 --topology 1x2 --dtype all --reps 20"
for i in 1 2 3; do
  run sm_$i timeout 60 $B --json $OUT/sm_$i.json
  run ce4_$i env MOELINK_HT_CE_PIECES=4 timeout 60 $B --json $OUT/ce4_$i.json
done
run ce2 env MOELINK_HT_CE_PIECES=2 timeout 60 $B
run ce4_sweep env MOELINK_HT_CE_PIECES=4 timeout 90 $B --routing uniform,skewed --tokens 1,512,4096
run sm_sweep timeout 90 $B --routing uniform,skewed --tokens 1,512,4096
cat $OUT/summary.txt
grep -A5 "^mode" $OUT/log.txt | grep "^ht" | head -80
