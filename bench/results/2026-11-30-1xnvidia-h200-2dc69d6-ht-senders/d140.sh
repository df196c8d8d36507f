#!/usr/bin/env bash
# Call 140 (1 x H200: the two ranks of EP2 share the GPU, no NVLink figure; issue 31). prof = head (2dc69d6)
# + clock64 stamps in the HT dispatch senders' token loop, accumulated per warp and printed by lane 0 of
# every 4th warp of every 3rd sender block (experiment build, not committed): where a sender warp's time goes
# (load wait, payload store issue, meta, staging the next token, batch fence; per batch: the error check,
# the chunk grab with the next chunk's prefix and staging, the flags). Real, senders alone, and senders
# alone with fixed shares (MOELINK_HT_DYNAMIC_SEND=0: no chunk counter).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT)+prof NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
S=/tmp/s140; mkdir -p $S
nvidia-smi -L > $S/gpus.txt
nvidia-smi -q -d CLOCK | grep -A4 "^    Clocks$\|Max Clocks" > $S/clocks.txt
timeout -k 5 90 .device/exp/moelink-prof bench --mode ht --ranks 2 --topology 1x2 --reps 5 --warmup 1 --no-host-check --json $S/real.json > $S/real.log 2>&1
echo "real rc=$?"; grep -E "^ht " $S/real.log | cut -c1-80
MOELINK_HT_TIMING_EXPERIMENT=5 timeout -k 5 90 .device/exp/moelink-prof bench --mode ht --ranks 2 --topology 1x2 --reps 5 --warmup 1 --no-host-check --json $S/send.json > $S/send.log 2>&1
echo "send rc=$?"; grep -E "^ht " $S/send.log | cut -c1-80
MOELINK_HT_DYNAMIC_SEND=0 MOELINK_HT_TIMING_EXPERIMENT=5 timeout -k 5 90 .device/exp/moelink-prof bench --mode ht --ranks 2 --topology 1x2 --reps 5 --warmup 1 --no-host-check --json $S/send-fixed.json > $S/send-fixed.log 2>&1
echo "send-fixed rc=$?"; grep -E "^ht " $S/send-fixed.log | cut -c1-80
for f in real send send-fixed; do
  echo "== $f (per token, cycles; lines: warps sampled over all launches)"
  grep "^PROF" $S/$f.log | python3 -c "
import sys, collections
names = ['total','pre','wait','store','meta','stage','fence','check','grab','flags','loop']
acc = collections.defaultdict(lambda: [0]*(2+len(names)))
for l in sys.stdin:
    kv = dict(x.split('=') for x in l.split()[1:])
    key = 'fp8=%s topk=%s' % (kv['fp8'], kv['topk'])
    a = acc[key]; a[0] += 1; a[1] += int(kv['tokens'])
    for i, k in enumerate(names): a[2+i] += int(kv[k])
for k, a in sorted(acc.items()):
    n = a[1] or 1
    print(k, 'warps', a[0], 'tokens/warp %.1f' % (a[1]/a[0]), ' '.join('%s %.0f' % (nm, x/n) for nm, x in zip(names, a[2:])), 'rest %.0f' % ((a[2] - sum(a[3:]))/n))
"
done
tar -C /tmp -czf $OUT/call140.tgz s140
