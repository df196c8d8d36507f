#!/usr/bin/env bash
# Call 61 (1 x H200): 0e039db. The python step's hostcost with 2 ranks sharing the GPU under MPS (50 % each):
# moelink beside DeepEP's HT ops, the Python GPU suite at 2 ranks, DeepEP's tests through share_gpus (intranode
# both systems, low-latency against moelink), one repeat of the host-cost bench, one Rust/Python HT alternation.
set -u
cd "$(dirname "$0")/.."
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=1 T_PYTHON=560 BUDGET_S=575 OUT=/tmp/o61 W=/tmp/w61 \
  bash scripts/device/run.sh 2>&1 | tail -n 75
mkdir -p /tmp/s61 && cp -r /tmp/w61/python/. /tmp/s61/ 2>/dev/null; cp /tmp/o61/* /tmp/s61/ 2>/dev/null
tar -C /tmp -czf $OUT/call61.tgz s61
