#!/usr/bin/env bash
# Call 75 (2 x H200, nvidia-h200-x2): the hostcost step on two GPUs (issue 26's targets where they are set: a
# GPU per rank, DeepEP's LL native), then the peer bandwidth and the Rust bench at EP2, 24 SMs (issue 31).
set -u
cd "$(dirname "$0")/.."
STEPS="python nvlink bench" PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=1 T_PYTHON=280 T_BENCH=90 BUDGET_S=390 \
  BENCH_ARGS="--mode all --ranks 2 --reps 20 --num-sms 24 --ll-trace" OUT=/tmp/o75 W=/tmp/w75 \
  bash scripts/device/run.sh 2>&1 | tail -n 70
mkdir -p /tmp/s75 && cp -r /tmp/w75/python/. /tmp/s75/ 2>/dev/null; cp /tmp/o75/* /tmp/s75/ 2>/dev/null
tar -C /tmp -czf $OUT/call75.tgz s75
