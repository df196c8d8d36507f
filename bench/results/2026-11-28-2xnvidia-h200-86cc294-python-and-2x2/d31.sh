#!/usr/bin/env bash
# Call 31 (2 x H200): the session's head (rows on 128-byte lines one node and across, LL across nodes a message
# per block). (1) The Python API beside DeepEP: the host-cost bench, the Python GPU suite at 2 ranks, DeepEP's
# own test_intranode.py and test_low_latency.py against moelink as deep_ep and against DeepEP; (2) HT and LL
# across 2x2 virtual nodes (4 ranks sharing the 2 GPUs, thread mode) over ptr.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/py" "$OUT/n22"
STEPS="python" PY_STEPS="hostcost" PY_CONNECTIONS=default T_PYTHON=420 BUDGET_S=430 OUT=$OUT/py W=/tmp/w31p \
  bash scripts/device/run.sh > /tmp/w31p.log 2>&1
tail -60 /tmp/w31p.log | grep -v "^\s*$" | tail -45
grep -E "passed|failed|Error|error" /tmp/w31p/python/gpu-tests-2.log 2>/dev/null | tail -3
grep -E -i "passed|failed|assert|Traceback|Dispatch \+ combine|Best|GB/s" /tmp/w31p/python/deepep-tests.log 2>/dev/null | tail -12
grep -E -i "Best|Dispatch \+ combine" /tmp/w31p/python/deepep-baseline.log 2>/dev/null | tail -8
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=120 SWEEP_ARGS="--mode all --ranks 4 --topology 2x2 --transport ptr --reps 5" \
  BUDGET_S=130 OUT=$OUT/n22 W=/tmp/w31n bash scripts/device/run.sh > /tmp/w31n.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w31n/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("2x2 ptr", r.get("mode"), r.get("op"), r.get("dtype"), r.get("status"), r.get("num_sms"), "time", r.get("time_us"), "cached", r.get("cached_us"), "rdma", r.get("rdma_bytes"), "nvl", r.get("nvl_bytes"), "match", r.get("matches_host"))
PY
