#!/usr/bin/env bash
# Call 81 (2 x H200, a GPU per rank; issue 29): 3e0b151's internode kernels between two real GPUs as 2 nodes x 1,
# NVLink standing in for RDMA. 1. The procbench step: HT and LL at DeepEP's shapes, 24 SMs, 10 reps, one rank per
# process over nvshmem and over ptr. 2. HT over the emulated NIC at 50 GB/s (16 NIC blocks), thread mode, 5 reps.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/s81
t0=$(date +%s)
STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem ptr" PROCBENCH_ARGS="--mode all --reps 10 --num-sms 24" T_PROCBENCH=220 BUDGET_S=230 \
  OUT=/tmp/o81 W=/tmp/w81 bash scripts/device/run.sh 2>&1 | grep -E "^(ht|ll) |procbench|rc=" | head -30
cp /tmp/o81/*.json /tmp/s81/ 2>/dev/null; cp /tmp/w81/*/log.txt /tmp/s81/procbench-log.txt 2>/dev/null
echo "procbench done at $(( $(date +%s) - t0 )) s"
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 80 .device/moelink bench --mode ht --ranks 2 --topology 2x1 --num-sms 24 --reps 5 \
  --transport emu-nic:rate=50,reorder=0,nic-blocks=16 --json /tmp/s81/nic-2x1.json > /tmp/s81/nic-2x1.log 2>&1
echo "nic rc=$?"; grep -E "^ht " /tmp/s81/nic-2x1.log
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call81.tgz s81
