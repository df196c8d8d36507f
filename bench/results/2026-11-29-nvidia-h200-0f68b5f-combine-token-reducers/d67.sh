#!/usr/bin/env bash
# Call 67 (1 x H200): 0f68b5f (the combine reducers take tokens one at a time) under the soaks and kill-a-rank:
# the 2x2 emu-nic soak with reordering, a 2x1 ptr soak, then an HT dispatch and an HT combine with a rank
# SIGKILLed, 4 processes under MPS, 2x2 over the emulated NIC.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p /tmp/s67
export MOELINK_COMMIT=$HEAD_COMMIT
timeout 60 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s67/soak-2x2-nic.json" --ranks 4 --topology 2x2 \
  --transport emu-nic:reorder=20,nic-blocks=3 --t-max 512 --ht-round-tokens 96 --time-budget-s 35 > /tmp/s67a.log 2>&1; echo "soak 2x2 nic rc=$?"
grep -E "^(ht|ll)|^soak|ERROR" /tmp/s67a.log | cut -c1-200 | head -8
timeout 40 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s67/soak-2x1-ptr.json" --ranks 2 --topology 2x1 \
  --transport ptr --t-max 1024 --ht-round-tokens 128 --time-budget-s 20 > /tmp/s67b.log 2>&1; echo "soak 2x1 ptr rc=$?"
grep -E "^soak|ERROR" /tmp/s67b.log | cut -c1-200
unset CUDA_DEVICE_MAX_CONNECTIONS
STEPS="reliability" RELIABILITY_STEPS="chaos" RANKS=4 CHAOS_ARGS="--topology 2x2 --transport emu-nic" CHAOS_RUNS="ht-dispatch ht-combine" \
  T_RELIABILITY=170 BUDGET_S=180 OUT=/tmp/s67/r W=/tmp/w67r bash scripts/device/run.sh > /tmp/w67r.log 2>&1
python3 - <<'PY'
import json
try: d = json.load(open("/tmp/w67r/reliability/reliability.json"))
except Exception as e: print("no reliability.json", e); raise SystemExit
print(d.get("commit"), d.get("steps"))
for c in d.get("chaos", []):
    print(c.get("run"), c.get("verdict"), [(s.get("rank"), s.get("verdict"), s.get("within_deadline"), s.get("recovered"), s.get("error_kind")) for s in c.get("survivors", [])])
PY
cp /tmp/w67r/reliability/reliability.json /tmp/s67/ 2>/dev/null
tar -C /tmp -czf $OUT/call67.tgz s67
