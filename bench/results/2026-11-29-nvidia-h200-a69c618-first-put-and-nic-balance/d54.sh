#!/usr/bin/env bash
# Call 54 (1 x H200: ranks share the GPU): the emulated NIC's blocks serve any QP (claimed one descriptor at
# a time, oldest first) instead of the QPs q % blocks. ht_internode, internode_gpu, ll_internode_gpu; HT 2x1
# over the emulated NIC at 50 GB/s, head against 43a4f2e (blocks tied to QPs) in the same call, 8/16/24
# blocks; traced at 16; soak 2x2 emu-nic with reordering.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p "$OUT/b" /tmp/s54
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu moelink.test.ll_internode_gpu" T_TESTS=200 BUDGET_S=210 OUT=/tmp/t54 W=/tmp/w54t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
bench() {  # label binary commit reps transport [env...]
  local label=$1 bin=$2 commit=$3 reps=$4 tr=$5; shift 5
  timeout 100 env MOELINK_COMMIT=$commit MOELINK_CACHE_DIR=/tmp/jit54-$commit "$@" $bin bench --mode ht --ranks 2 --topology 2x1 --reps $reps \
    --transport $tr --json "/tmp/s54/$label.json" > /tmp/$label.log 2>&1
  echo "$label rc=$?"
  python3 - "/tmp/s54/$label.json" "$label" <<'PY'
import json, sys
try: recs = json.load(open(sys.argv[1]))
except Exception as e: print(sys.argv[2], "no records", e); sys.exit()
for r in recs:
    print(sys.argv[2], r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
}
NIC=emu-nic:rate=50,reorder=0
bench nic16-base .device/base/moelink-43a4f2e 43a4f2e 5 $NIC,nic-blocks=16
bench nic16-head .device/moelink $HEAD_COMMIT 5 $NIC,nic-blocks=16
bench nic8-head .device/moelink $HEAD_COMMIT 5 $NIC,nic-blocks=8
bench nic24-head .device/moelink $HEAD_COMMIT 5 $NIC,nic-blocks=24
bench nic24-base .device/base/moelink-43a4f2e 43a4f2e 5 $NIC,nic-blocks=24
bench nic16-head-traced .device/moelink $HEAD_COMMIT 3 $NIC,nic-blocks=16 MOELINK_HT_TRACE=1
cp /tmp/nic16-head-traced.log /tmp/s54/nic16-head-traces.log
python3 .dv/tracepoints.py /tmp/nic16-head-traced.log send_end,chunk_put,recv_end,nic_first_put,nic_last_put,nic_busy_us,reduce_end 1
export MOELINK_COMMIT=$HEAD_COMMIT MOELINK_CACHE_DIR=/tmp/jit54-$HEAD_COMMIT
timeout 75 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s54/soak-2x2-nic.json" --ranks 4 --topology 2x2 \
  --transport emu-nic:reorder=20,nic-blocks=3 --t-max 512 --ht-round-tokens 96 --time-budget-s 40 > /tmp/s54a.log 2>&1; echo "soak 2x2 nic rc=$?"
grep -E "^(ht|ll)|^soak|ERROR|buffers for" /tmp/s54a.log | cut -c1-250 | head -9
cp /tmp/t54/summary.md /tmp/s54/tests-summary.md 2>/dev/null
tar -C /tmp -czf $OUT/call54.tgz s54
