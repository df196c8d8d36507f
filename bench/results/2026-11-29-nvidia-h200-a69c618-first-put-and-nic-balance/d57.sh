#!/usr/bin/env bash
# Call 57 (1 x H200: ranks share the GPU): the session's last code commit (a7203bc: a69c618's kernels, the
# combine groups reverted), full build. Every carried GPU test; kill-a-rank in an HT dispatch and an HT
# combine, 4 processes under MPS, 2x2 over the emulated NIC; a 2x1 ptr soak.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p /tmp/s57
STEPS="tests" T_TESTS=330 BUDGET_S=340 OUT=/tmp/t57 W=/tmp/w57t bash scripts/device/run.sh > /tmp/t57.log 2>&1
grep -E "^test result|FAILED|panicked|timed out" /tmp/t57.log | sort | uniq -c | head -20
cp /tmp/t57/summary.md /tmp/s57/tests-summary.md 2>/dev/null; gzip -c /tmp/t57.log > /tmp/s57/tests.log.gz
STEPS="reliability" RELIABILITY_STEPS="chaos" RANKS=4 CHAOS_ARGS="--topology 2x2 --transport emu-nic" CHAOS_RUNS="ht-dispatch ht-combine" \
  T_RELIABILITY=60 BUDGET_S=70 OUT=/tmp/s57/r W=/tmp/w57r bash scripts/device/run.sh > /tmp/w57r.log 2>&1
python3 - <<'PY'
import json
try: d = json.load(open("/tmp/w57r/reliability/reliability.json"))
except Exception as e: print("no reliability.json", e); raise SystemExit
for c in d.get("chaos", []):
    print(c.get("run"), c.get("verdict"), [(s.get("rank"), s.get("verdict"), s.get("within_deadline"), s.get("recovered")) for s in c.get("survivors", [])])
PY
cp /tmp/w57r/reliability/reliability.json /tmp/s57/ 2>/dev/null
export MOELINK_COMMIT=$HEAD_COMMIT
timeout 45 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s57/soak-2x1-ptr.json" --ranks 2 --topology 2x1 \
  --transport ptr --t-max 1024 --ht-round-tokens 128 --time-budget-s 25 > /tmp/s57b.log 2>&1; echo "soak 2x1 ptr rc=$?"
grep -E "^soak" /tmp/s57b.log | cut -c1-200
tar -C /tmp -czf $OUT/call57.tgz s57
