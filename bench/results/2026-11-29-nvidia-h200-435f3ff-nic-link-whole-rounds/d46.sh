#!/usr/bin/env bash
# Call 46 (1 x H200: ranks share the GPU): 77a5030's reliability across virtual nodes, and the whole-round
# sizing at 2x2. 1. soak, 4 ranks as 2x2 over the emulated NIC (reordering, 2 NIC blocks), HT families,
# rounds of 96 tokens (hand-backs every call); 2. kill-a-rank in an HT dispatch and an HT combine, 4 processes
# under MPS, 2x2 over the emulated NIC; 3. HT at 2x2 over ptr (4 ranks on the GPU, 5 reps).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/r" "$OUT/b"
STEPS="reliability" RELIABILITY_STEPS="soak chaos" SOAK_S=75 \
  SOAK_ARGS="--ranks 4 --topology 2x2 --transport emu-nic:reorder=20,nic-blocks=2 --families ht,ht-cached --t-max 512 --ht-round-tokens 96" \
  RANKS=4 CHAOS_ARGS="--topology 2x2 --transport emu-nic" CHAOS_RUNS="ht-dispatch ht-combine" \
  T_RELIABILITY=300 BUDGET_S=310 OUT=$OUT/r W=/tmp/w46r bash scripts/device/run.sh > /tmp/w46r.log 2>&1
grep -E "soak|rounds|mismatch|CHAOS_|PASS|FAIL|error" /tmp/w46r/reliability/soak-log.txt 2>/dev/null | tail -8
grep -h "CHAOS_" /tmp/w46r/reliability/*.txt /tmp/w46r/reliability/*.log 2>/dev/null | cut -c1-220 | head -12
tail -15 /tmp/w46r.log
cp /tmp/w46r/reliability/reliability.json /tmp/w46r/reliability/soak.json $OUT/r/ 2>/dev/null
STEPS="sweep" SWEEP="-" T_SWEEP_EACH=120 SWEEP_ARGS="--mode ht --ranks 4 --topology 2x2 --reps 5 --transport ptr" \
  BUDGET_S=130 OUT=$OUT/b W=/tmp/w46p bash scripts/device/run.sh > /tmp/w46p.log 2>&1
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/w46p/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        print("2x2 ptr", r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
cp /tmp/w46p/sweep/sweep-1.json $OUT/b/ptr-2x2-sweep.json 2>/dev/null
