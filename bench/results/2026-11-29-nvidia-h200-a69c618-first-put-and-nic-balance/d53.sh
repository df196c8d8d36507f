#!/usr/bin/env bash
# Call 53 (1 x H200: ranks share the GPU): the dispatch's senders stage token by token (the chunk goes out
# when its last token is staged, by whichever warp). ht_internode and internode_gpu; HT 2x1 over ptr and over
# the emulated NIC at 50 GB/s (16 blocks), head against daabe46's binary in the same call; traced head;
# soaks with many rounds (2x2 emu-nic with reordering, 2x1 ptr).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p "$OUT/b" "$OUT/s"
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=160 OUT=$OUT/t W=/tmp/w53t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
bench() {  # label binary commit reps transport [env...]
  local label=$1 bin=$2 commit=$3 reps=$4 tr=$5; shift 5
  timeout 100 env MOELINK_COMMIT=$commit MOELINK_CACHE_DIR=/tmp/jit53-$commit "$@" $bin bench --mode ht --ranks 2 --topology 2x1 --reps $reps \
    --transport $tr --json "$OUT/b/$label.json" > /tmp/$label.log 2>&1
  echo "$label rc=$?"
  python3 - "$OUT/b/$label.json" "$label" <<'PY'
import json, sys
try: recs = json.load(open(sys.argv[1]))
except Exception as e: print(sys.argv[2], "no records", e); sys.exit()
for r in recs:
    print(sys.argv[2], r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
}
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
bench ptr-base .device/base/moelink-daabe46 daabe46 10 ptr
bench ptr-head .device/moelink $HEAD_COMMIT 10 ptr
bench nic-base .device/base/moelink-daabe46 daabe46 5 $NIC
bench nic-head .device/moelink $HEAD_COMMIT 5 $NIC
bench nic-head-traced .device/moelink $HEAD_COMMIT 3 $NIC MOELINK_HT_TRACE=1
cp /tmp/nic-head-traced.log $OUT/b/nic-head-traces.log
python3 .dv/tracepoints.py /tmp/nic-head-traced.log send_end,chunk_put,stage_us,fwd_end,recv_end,nic_first_put,nic_last_put,reduce_end 1
bench ptr-head-traced .device/moelink $HEAD_COMMIT 3 ptr MOELINK_HT_TRACE=1
cp /tmp/ptr-head-traced.log $OUT/b/ptr-head-traces.log
python3 .dv/tracepoints.py /tmp/ptr-head-traced.log send_end,chunk_put,stage_us,fwd_end,recv_end 1
export MOELINK_COMMIT=$HEAD_COMMIT MOELINK_CACHE_DIR=/tmp/jit53-$HEAD_COMMIT
timeout 75 .device/moelink-stress soak --backend cuda --progress-s 200 --json "$OUT/s/soak-2x2-nic.json" --ranks 4 --topology 2x2 \
  --transport emu-nic:reorder=20,nic-blocks=2 --t-max 512 --ht-round-tokens 96 --time-budget-s 40 > /tmp/s53a.log 2>&1; echo "soak 2x2 nic rc=$?"
grep -E "^(ht|ll)|^soak|ERROR|buffers for" /tmp/s53a.log | cut -c1-250 | head -9
timeout 60 .device/moelink-stress soak --backend cuda --progress-s 200 --json "$OUT/s/soak-2x1-ptr.json" --ranks 2 --topology 2x1 \
  --transport ptr --t-max 1024 --ht-round-tokens 128 --time-budget-s 30 > /tmp/s53b.log 2>&1; echo "soak 2x1 ptr rc=$?"
grep -E "^(ht|ll)|^soak|ERROR|buffers for" /tmp/s53b.log | cut -c1-250 | head -9
