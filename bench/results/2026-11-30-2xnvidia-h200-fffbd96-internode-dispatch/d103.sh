#!/usr/bin/env bash
# Call 103 (2 x H200, issue 29): fffbd96's internode HT dispatch with odd chunks (MOELINK_HT_SEND_CHUNK 9 and 11; a round holds at most 512 chunks, so smaller ones are raised at these shapes),
# where a sender's two-token group falls in two chunks (and rounds of an odd multiple in two rounds), checked
# against the host bit for bit: 2x1 over ptr (a GPU per rank) and 2x2 over ptr and the emulated NIC (4 ranks on
# the 2 GPUs), DeepEP's shapes, 24 SMs. Also the default chunk's trace (MOELINK_HT_TRACE) at 2x1.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s103; mkdir -p $S; H=.device/moelink
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
for q in 9 11; do
  MOELINK_HT_SEND_CHUNK=$q timeout -k 5 90 $H bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 --reps 5 \
    --json $S/n21-chunk$q.json > $S/n21-chunk$q.log 2>&1
  echo "2x1 chunk $q rc=$? at $(el)"; grep -E "^ht |round|chunk" $S/n21-chunk$q.log | cut -c1-100 | head -8
done
MOELINK_HT_SEND_CHUNK=9 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $H bench --mode ht --ranks 4 --topology 2x2 --transport ptr --num-sms 24 --reps 3 \
  --json $S/n22-ptr-chunk9.json > $S/n22-ptr-chunk9.log 2>&1
echo "2x2 ptr chunk 9 rc=$? at $(el)"; grep -E "^ht " $S/n22-ptr-chunk9.log | cut -c1-100
MOELINK_HT_SEND_CHUNK=9 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 90 $H bench --mode ht --ranks 4 --topology 2x2 --num-sms 24 --reps 3 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json $S/n22-nic-chunk9.json > $S/n22-nic-chunk9.log 2>&1
echo "2x2 nic chunk 9 rc=$? at $(el)"; grep -E "^ht " $S/n22-nic-chunk9.log | cut -c1-100
MOELINK_HT_TRACE=1 timeout -k 5 60 $H bench --mode ht --ranks 2 --topology 2x1 --transport ptr --dtype all --num-sms 24 --reps 5 --warmup 2 \
  --no-host-check --json $S/trace-head.json > $S/trace-head.log 2>&1
echo "trace rc=$? at $(el)"
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call103.tgz s103
