#!/usr/bin/env bash
# Call 62 (1 x H200): 44128f3. The python step's hostcost again (ranks sharing the GPU), with two alternations of
# the Rust HT bench (process mode under MPS, as the Python one) and the Python fresh HT dispatch.
set -u
cd "$(dirname "$0")/.."
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=1 HOSTCOST_ALTERNATE=2 T_PYTHON=560 BUDGET_S=575 OUT=/tmp/o62 W=/tmp/w62 \
  bash scripts/device/run.sh 2>&1 | tail -n 75
mkdir -p /tmp/s62 && cp -r /tmp/w62/python/. /tmp/s62/ 2>/dev/null; cp /tmp/o62/* /tmp/s62/ 2>/dev/null
tar -C /tmp -czf $OUT/call62.tgz s62
