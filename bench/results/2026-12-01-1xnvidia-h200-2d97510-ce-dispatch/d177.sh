# call 177 (1xH200): the copy-engine cached dispatch (MOELINK_HT_CE_PIECES), 2 ranks sharing the GPU:
# correctness (the ht test executable, host oracle), then bench A/B against the SM senders.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
D=.device
nvidia-smi -L > $OUT/gpu.txt
date -u > $OUT/date.txt
run() { local name=$1; shift; local t0=$(date +%s); "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? s=$(( $(date +%s) - t0 ))" >> $OUT/summary.txt; }
run test_ce4 env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=4 timeout 200 $D/tests/moelink.test.ht --include-ignored --test-threads=1
run test_ce1 env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=1 timeout 120 $D/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
B="$D/moelink bench --mode ht --ranks 2 --topology 1x2 --dtype all --reps 20"
for i in 1 2; do
  run sm_$i timeout 90 $B --json $OUT/sm_$i.json
  run ce4_$i env MOELINK_HT_CE_PIECES=4 timeout 90 $B --json $OUT/ce4_$i.json
done
run ce2 env MOELINK_HT_CE_PIECES=2 timeout 90 $B --json $OUT/ce2.json
run ce8 env MOELINK_HT_CE_PIECES=8 timeout 90 $B --json $OUT/ce8.json
run ce4_skew env MOELINK_HT_CE_PIECES=4 timeout 90 $B --routing skewed --tokens 0,1,512 --json $OUT/ce4_skew.json
cat $OUT/summary.txt
grep -h "cached\|combine\|dispatch" $OUT/sm_1.txt $OUT/ce4_1.txt | head -40
