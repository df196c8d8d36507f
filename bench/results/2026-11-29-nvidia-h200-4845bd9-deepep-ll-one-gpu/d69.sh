#!/usr/bin/env bash
# Call 69 (1 x H200): af0fa24. Whether DeepEP's LL runs with two processes on one GPU once the runtime reports
# each process's MPS share of the SMs (share_sms.c), then the hostcost step with DeepEP's LL beside moelink.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/s69
# The SMs torch reports: alone, then as an MPS client held to 50 % (the fact the hypothesis rests on).
python3 -c 'import torch; print("alone:", torch.cuda.get_device_properties(0).multi_processor_count)' > /tmp/s69/sms.txt 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps69p CUDA_MPS_LOG_DIRECTORY=/tmp/mps69l
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 python3 -c 'import torch; print("mps client at 50 %:", torch.cuda.get_device_properties(0).multi_processor_count)' >> /tmp/s69/sms.txt 2>&1
echo quit | nvidia-cuda-mps-control; sleep 2
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
cat /tmp/s69/sms.txt
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=0 T_PYTHON=540 BUDGET_S=560 OUT=/tmp/o69 W=/tmp/w69 \
  bash scripts/device/run.sh 2>&1 | tail -n 80
cp -r /tmp/w69/python/. /tmp/s69/ 2>/dev/null; cp /tmp/o69/* /tmp/s69/ 2>/dev/null
tar -C /tmp -czf $OUT/call69.tgz s69
