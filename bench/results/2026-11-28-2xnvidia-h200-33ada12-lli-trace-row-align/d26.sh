#!/usr/bin/env bash
# Call 26 (2 x H200): dev1 = 1b4251f (LL-across-nodes trace stamps) + bd54112 (HT slab rows padded to 128 B).
# (1) LL across nodes, 2x1 over ptr, with --ll-trace: where the 92/133 us go (issue 29), beside the one-node
#     LL at EP2 with its trace. (2) A/B of the row padding at EP2, 24 SMs: base 13f262e vs this build (issue 31).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/lli" "$OUT/ab" "$OUT/t"
STEPS="tests" TEST_BINS="moelink.test.ht" T_TESTS=150 BUDGET_S=170 OUT=$OUT/t W=/tmp/w26t bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head
STEPS="sweep" SWEEP="- -" T_SWEEP_EACH=120 \
  SWEEP_ARGS="--mode ll --ranks 2 --topology 2x1 --transport ptr --reps 20 --ll-trace" \
  BUDGET_S=200 OUT=$OUT/lli W=/tmp/w26a bash scripts/device/run.sh 2>&1 | tail -8
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=90 SWEEP_ARGS="--mode ll --ranks 2 --reps 20 --ll-trace" \
  BUDGET_S=100 OUT=$OUT/lli/one W=/tmp/w26b bash scripts/device/run.sh 2>&1 | tail -5
STEPS="ab" AB_ROUNDS=3 AB_ARGS="--mode ht --ranks 2 --reps 20 --num-sms 24" BUDGET_S=200 OUT=$OUT/ab W=/tmp/w26c \
  bash scripts/device/run.sh 2>&1 | grep -E "^\|"
python3 - /tmp <<'PY'
import json, sys, glob
for f in sorted(glob.glob("/tmp/w26a/sweep/sweep-*.json") + glob.glob("/tmp/w26b/sweep/sweep-*.json")):
    d = json.load(open(f))
    recs = d if isinstance(d, list) else d.get("records", [])
    for r in recs:
        print(f, r.get("op"), r.get("dtype"), r.get("status"), "time", r.get("time_us"), "kernel", r.get("kernel_us"), "b2b", r.get("loop_pair_us"))
        for k in ("kernel_trace", "loop_dispatch_trace", "loop_combine_trace"):
            if k in r:
                print("  ", k, " ".join(f"{p['point']}={p['median_us']:.1f}/{p['last_us']:.1f}" + (f"[b0 {p['block0_us']:.1f}]" if p.get('block0_us') is not None else "") for p in r[k]))
PY
