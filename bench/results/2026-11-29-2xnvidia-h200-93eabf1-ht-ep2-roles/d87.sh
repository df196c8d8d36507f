#!/usr/bin/env bash
# Call 87 (2 x H200, issue 31): the HT combine at 8, 16 and 24 SMs, four builds that differ only in ht_combine.cu
# (the dispatch kernel is the same in the last three): base d386798; nopf (59ff347: next chunk taken at the
# last fence); before (5e60697: also the L2 prefetch of the next chunk's rows, issued before the fence);
# after (the prefetch issued after the fence). 3 rounds alternating, BF16, 4096 tokens.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s87; mkdir -p $S
t0=$(date +%s)
for i in 1 2 3; do for w in base nopf before after; do b=.device/v/moelink-$w; [ $w = base ] && b=.device/base/moelink
  c=$w; [ $w = base ] && c=d386798; [ $w = nopf ] && c=59ff347; [ $w = before ] && c=5e60697; [ $w = after ] && c=5e60697+after
  MOELINK_COMMIT=$c timeout -k 5 90 $b bench --mode ht --dtype bf16 --num-sms 8,16,24 --reps 20 --no-host-check --json $S/c-$w-$i.json > $S/c-$w-$i.log 2>&1
  echo "$w $i rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ht +combine" $S/c-$w-$i.log; done; done
MOELINK_COMMIT=5e60697+after timeout -k 5 150 .device/v/moelink-after bench --mode ht --dtype bf16 --num-sms 8,24 --reps 10 --json $S/after-checked.json > $S/after-checked.log 2>&1
echo "after checked rc=$?"; grep -E "^ht " $S/after-checked.log
tar -C /tmp -czf $OUT/call87.tgz s87
