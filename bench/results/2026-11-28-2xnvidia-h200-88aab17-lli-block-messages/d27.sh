#!/usr/bin/env bash
# Call 27 (2 x H200): 9ad... the internode LL kernels with a message per block. (1) ll_internode_gpu (LL across
# 2x2, 2x4, 4x2 virtual nodes on ptr and emu-nic against the host backend); (2) A/B at 2x1 over ptr with
# traces: base 33ada12 vs this build; (3) HT and LL across nodes in NVSHMEM processes (2x1); (4) LL soak
# across 2x2 over emu-nic.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t" "$OUT/ab" "$OUT/proc" "$OUT/soak"
STEPS="tests" TEST_BINS="moelink.test.ll_internode_gpu" T_TESTS=200 BUDGET_S=220 OUT=$OUT/t W=/tmp/w27t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked|^test " | head -20
STEPS="ab" AB_ROUNDS=3 AB_ARGS="--mode ll --ranks 2 --topology 2x1 --transport ptr --reps 20 --ll-trace" BUDGET_S=150 \
  OUT=$OUT/ab W=/tmp/w27a bash scripts/device/run.sh 2>&1 | grep -E "^\||rc="
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w27a/ab/ab-*.json")):
    for r in json.load(open(f)):
        print(f.split("/")[-1], r.get("op"), r.get("status"), "time %.1f" % r.get("time_us", -1), "kernel", r.get("kernel_us"), "b2b", r.get("loop_pair_us"))
        if "kernel_trace" in r:
            print("   ", " ".join(f"{p['point']}={p['median_us']:.1f}/{p['last_us']:.1f}" + (f"[b0 {p['block0_us']:.1f}]" if p.get('block0_us') is not None else "") for p in r["kernel_trace"]))
PY
STEPS="procbench" PROCBENCH_TRANSPORTS="nvshmem" PROCBENCH_ARGS="--mode all --reps 10" T_PROCBENCH=200 BUDGET_S=210 \
  OUT=$OUT/proc W=/tmp/w27p bash scripts/device/run.sh > /tmp/w27p.log 2>&1; tail -3 /tmp/w27p.log
python3 - "$OUT/proc/procbench-nvshmem.json" <<'PY'
import json, sys
try:
    recs = json.load(open(sys.argv[1]))
except Exception as e:
    print("procbench:", e); sys.exit()
for r in recs:
    print("proc nvshmem", r.get("mode"), r.get("op"), r.get("dtype"), r.get("status"), r.get("num_sms"), "time", r.get("time_us"), "cached", r.get("cached_us"), "matches_host", r.get("matches_host"))
PY
STEPS="internode" INTERNODE_STEPS="soak" SOAK_S=40 T_INTERNODE=90 BUDGET_S=100 OUT=$OUT/soak W=/tmp/w27s \
  bash scripts/device/run.sh 2>&1 | tail -4
