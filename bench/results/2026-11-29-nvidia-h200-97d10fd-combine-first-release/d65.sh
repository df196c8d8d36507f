#!/usr/bin/env bash
# Call 65 (1 x H200): the procbench step on one GPU (2 processes under MPS, 50 % each) at 97d10fd, over nvshmem,
# ptr and the emulated NIC: HT and LL at DeepEP's shapes as 2x1 in process mode.
set -u
cd "$(dirname "$0")/.."
STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem ptr emu-nic" T_PROCBENCH=500 BUDGET_S=520 OUT=/tmp/o65 W=/tmp/w65 \
  bash scripts/device/run.sh > /tmp/w65.log 2>&1; echo "run rc=$?"
grep -E "^--- procbench|MPS daemon|^(ht|ll) |error|Error" /tmp/w65.log | cut -c1-200 | head -30
mkdir -p /tmp/s65 && cp /tmp/o65/procbench-*.json /tmp/s65/ 2>/dev/null; cp /tmp/w65.log /tmp/s65/run.log
tar -C /tmp -czf $OUT/call65.tgz s65
