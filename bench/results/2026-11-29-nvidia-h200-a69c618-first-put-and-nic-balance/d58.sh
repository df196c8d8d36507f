#!/usr/bin/env bash
# Call 58 (1 x H200): kill-a-rank at a7203bc (call 57 left it out for budget): an HT dispatch and an HT
# combine, 4 processes under MPS, 2x2 over the emulated NIC.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p /tmp/s58
STEPS="reliability" RELIABILITY_STEPS="chaos" RANKS=4 CHAOS_ARGS="--topology 2x2 --transport emu-nic" CHAOS_RUNS="ht-dispatch ht-combine" \
  T_RELIABILITY=170 BUDGET_S=180 OUT=/tmp/s58/r W=/tmp/w58r bash scripts/device/run.sh > /tmp/w58r.log 2>&1
python3 - <<'PY'
import json
try: d = json.load(open("/tmp/w58r/reliability/reliability.json"))
except Exception as e: print("no reliability.json", e); raise SystemExit
print(d.get("commit"), d.get("steps"))
for c in d.get("chaos", []):
    print(c.get("run"), c.get("verdict"), [(s.get("rank"), s.get("verdict"), s.get("within_deadline"), s.get("recovered"), s.get("error_kind")) for s in c.get("survivors", [])])
PY
cp /tmp/w58r/reliability/reliability.json /tmp/s58/ 2>/dev/null
tar -C /tmp -czf $OUT/call58.tgz s58
