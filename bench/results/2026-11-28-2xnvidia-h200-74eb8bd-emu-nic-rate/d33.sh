#!/usr/bin/env bash
# Call 33 (2 x H200): the emulated NIC's rate cap shared by its blocks. internode_gpu (transport conformance
# on ptr and emu-nic) and ht_internode; then HT and LL at 2x1 over emu-nic at 50 GB/s with 1, 4 and 8 NIC blocks.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/t"
STEPS="tests" TEST_BINS="moelink.test.internode_gpu moelink.test.ht_internode" T_TESTS=150 BUDGET_S=160 OUT=$OUT/t W=/tmp/w33t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -10
for nb in 1 4 8; do
  mkdir -p "$OUT/nic$nb"
  STEPS="sweep" SWEEP="-" T_SWEEP_EACH=100 BUDGET_S=110 \
    SWEEP_ARGS="--mode all --ranks 2 --topology 2x1 --reps 5 --transport emu-nic:rate=50,reorder=0,nic-blocks=$nb" \
    OUT=$OUT/nic$nb W=/tmp/w33n$nb bash scripts/device/run.sh > /tmp/w33n$nb.log 2>&1
  python3 - "$nb" <<'PY'
import json, glob, sys
nb = sys.argv[1]
floor = {"dispatch": None}
for f in sorted(glob.glob(f"/tmp/w33n{nb}/sweep/sweep-*.json")):
    for r in json.load(open(f)):
        fl = r.get("rdma_bytes", 0) / 50e3
        print(f"nic-blocks={nb}", r.get("mode"), r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1),
              "cached", r.get("cached_us"), "floor@50 %.1f" % fl, "ratio %.2f" % (r.get("time_us", 0) / fl if fl else 0), "match", r.get("matches_host"))
PY
done
