#!/usr/bin/env bash
# Call 55 (1 x H200: ranks share the GPU): the emulated NIC's blocks serve their own QPs first and take the
# oldest descriptor of another QP only when none of theirs is ready (a69c618). ht_internode, internode_gpu, ll_internode_gpu; HT 2x1
# over the emulated NIC at 50 GB/s, head against 43a4f2e (blocks tied to QPs) and 70bdada (oldest of any QP) in the same call, 8/16/24
# blocks; traced at 16; soak 2x2 emu-nic with reordering.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p "$OUT/b" /tmp/s55
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu moelink.test.ll_internode_gpu" T_TESTS=200 BUDGET_S=210 OUT=/tmp/t55 W=/tmp/w55t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
bench() {  # label binary commit reps transport [env...]
  local label=$1 bin=$2 commit=$3 reps=$4 tr=$5; shift 5
  timeout 100 env MOELINK_COMMIT=$commit MOELINK_CACHE_DIR=/tmp/jit55-$commit "$@" $bin bench --mode ht --ranks 2 --topology 2x1 --reps $reps \
    --transport $tr --json "/tmp/s55/$label.json" > /tmp/$label.log 2>&1
  echo "$label rc=$?"
  python3 - "/tmp/s55/$label.json" "$label" <<'PY'
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
bench nic16-70bdada .device/base/moelink-70bdada 70bdada 5 $NIC,nic-blocks=16
bench nic16-head-traced .device/moelink $HEAD_COMMIT 3 $NIC,nic-blocks=16 MOELINK_HT_TRACE=1
cp /tmp/nic16-head-traced.log /tmp/s55/nic16-head-traces.log
python3 .dv/tracepoints.py /tmp/nic16-head-traced.log send_end,chunk_put,recv_end,nic_first_put,nic_last_put,nic_busy_us,reduce_end 1
export MOELINK_COMMIT=$HEAD_COMMIT MOELINK_CACHE_DIR=/tmp/jit55-$HEAD_COMMIT
timeout 75 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s55/soak-2x2-nic.json" --ranks 4 --topology 2x2 \
  --transport emu-nic:reorder=20,nic-blocks=3 --t-max 512 --ht-round-tokens 96 --time-budget-s 40 > /tmp/s55a.log 2>&1; echo "soak 2x2 nic rc=$?"
grep -E "^(ht|ll)|^soak|ERROR|buffers for" /tmp/s55a.log | cut -c1-250 | head -9
cp /tmp/t55/summary.md /tmp/s55/tests-summary.md 2>/dev/null
tar -C /tmp -czf $OUT/call55.tgz s55
