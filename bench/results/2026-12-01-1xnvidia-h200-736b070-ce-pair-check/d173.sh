#!/usr/bin/env bash
# Call 173: scripts/device/ce_pair.py (copy engines for the EP2 pair), with `moelink bench nvlink` (SM pair
# copy, 24 SMs) in the same call on 2 GPUs. On one GPU: a check of the script only.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s173; mkdir -p $S
nvidia-smi -L > $S/gpus.txt; ngpu=$(wc -l < $S/gpus.txt)
python3 -c "import triton; print('triton', triton.__version__)" > $S/triton.txt 2>&1
timeout -k 5 240 python3 scripts/device/ce_pair.py $S/ce-pair.json > $S/ce-pair.log 2>&1; echo "ce_pair rc=$?"; cat $S/ce-pair.log | tail -20
if [ "$ngpu" -ge 2 ]; then
  timeout -k 5 120 .device/moelink bench nvlink --sms 24 --json $S/nvlink.json > $S/nvlink.log 2>&1; echo "nvlink rc=$?"; tail -12 $S/nvlink.log
fi
tar -C /tmp -czf $OUT/call173.tgz s173
