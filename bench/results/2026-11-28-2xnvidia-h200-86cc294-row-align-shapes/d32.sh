#!/usr/bin/env bash
# Call 32 (2 x H200): issue 31's "no other shape gets slower" for the HT rows on 128-byte lines (single node):
# A/B of 86cc294 against 13f262e (before the padding) over the token sweep and skewed routing at EP2, and at
# 4 ranks sharing the 2 GPUs (1x4), 24 SMs.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/sweep2" "$OUT/share"
STEPS="ab" AB_ROUNDS=2 AB_ARGS="--mode ht --ranks 2 --tokens 512,1024,2048,8192 --routing uniform,skewed --reps 10" T_AB=330 BUDGET_S=340 \
  OUT=$OUT/sweep2 W=/tmp/w32a bash scripts/device/run.sh 2>&1 | grep -E "^\| ht|rc="
STEPS="ab" AB_ROUNDS=2 AB_ARGS="--mode ht --ranks 4 --topology 1x4 --routing uniform,skewed --reps 10" T_AB=150 BUDGET_S=160 \
  OUT=$OUT/share W=/tmp/w32b bash scripts/device/run.sh 2>&1 | grep -E "^\| ht|rc="
