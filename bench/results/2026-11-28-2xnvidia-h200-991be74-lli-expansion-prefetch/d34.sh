#!/usr/bin/env bash
# Call 34 (2 x H200): the LL-across-nodes expansion with the next item's loads in flight. ll_internode_gpu;
# A/B at 2x1 over ptr with traces (base fcce8a6, the kernels of 74eb8bd); LL in NVSHMEM processes.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/ab" "$OUT/proc"
STEPS="tests" TEST_BINS="moelink.test.ll_internode_gpu" T_TESTS=100 BUDGET_S=110 OUT=$OUT/t W=/tmp/w34t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -5
STEPS="ab" AB_ROUNDS=3 AB_ARGS="--mode ll --ranks 2 --topology 2x1 --transport ptr --reps 20 --ll-trace" BUDGET_S=120 \
  OUT=$OUT/ab W=/tmp/w34a bash scripts/device/run.sh 2>&1 | grep -E "^\| ll|rc="
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w34a/ab/ab-*.json")):
    for r in json.load(open(f)):
        if r.get("op") != "dispatch": continue
        t = {p["point"]: (p["median_us"], p["last_us"]) for p in r.get("kernel_trace", [])}
        print(f.split("/")[-1], "dispatch %.1f" % r["time_us"], "kernel", r.get("kernel_us"), "recv_indexed %s recv_stored %s end %s" % (t.get("recv_indexed"), t.get("recv_stored"), t.get("end")))
PY
STEPS="procbench" PROCBENCH_TRANSPORTS="nvshmem" PROCBENCH_ARGS="--mode ll --reps 20" T_PROCBENCH=100 BUDGET_S=110 \
  OUT=$OUT/proc W=/tmp/w34p bash scripts/device/run.sh > /tmp/w34p.log 2>&1
python3 - "$OUT/proc/procbench-nvshmem.json" <<'PY'
import json, sys
try:
    recs = json.load(open(sys.argv[1]))
except Exception as e:
    print("procbench:", e); sys.exit()
for r in recs:
    print("proc nvshmem", r.get("mode"), r.get("op"), r.get("dtype"), r.get("status"), "time", r.get("time_us"), "matches_host", r.get("matches_host"))
PY
