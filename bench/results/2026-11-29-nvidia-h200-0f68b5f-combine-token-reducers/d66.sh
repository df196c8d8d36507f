#!/usr/bin/env bash
# Call 66 (1 x H200: ranks share the GPU): the combine reducers take tokens one at a time (HEAD), against
# 97d10fd in the same call. ht_internode; HT 2x1 over ptr and over the emulated NIC (50 GB/s, 16 blocks), base and
# head alternated; the head traced over the emulated NIC.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p /tmp/s66
STEPS="tests" TEST_BINS="moelink.test.ht_internode" T_TESTS=150 BUDGET_S=160 OUT=/tmp/t66 W=/tmp/w66t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
cp /tmp/t66/summary.md /tmp/s66/tests-summary.md 2>/dev/null
bench() {  # label binary commit reps transport [env...]
  local label=$1 bin=$2 commit=$3 reps=$4 tr=$5; shift 5
  timeout 100 env MOELINK_COMMIT=$commit MOELINK_CACHE_DIR=/tmp/jit66-$commit "$@" $bin bench --mode ht --ranks 2 --topology 2x1 --reps $reps \
    --transport $tr --json "/tmp/s66/$label.json" > /tmp/$label.log 2>&1
  echo "$label rc=$?"
  python3 - "/tmp/s66/$label.json" "$label" <<'PY'
import json, sys
try: recs = json.load(open(sys.argv[1]))
except Exception as e: print(sys.argv[2], "no records", e); sys.exit()
for r in recs:
    print(sys.argv[2], r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
}
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BASE=.device/base/moelink-97d10fd
bench ptr-base $BASE 97d10fd 10 ptr
bench ptr-head .device/moelink $HEAD_COMMIT 10 ptr
bench nic-base $BASE 97d10fd 5 $NIC
bench nic-head .device/moelink $HEAD_COMMIT 5 $NIC
bench ptr-base2 $BASE 97d10fd 10 ptr
bench ptr-head2 .device/moelink $HEAD_COMMIT 10 ptr
bench nic-head-traced .device/moelink $HEAD_COMMIT 3 $NIC MOELINK_HT_TRACE=1
cp /tmp/nic-head-traced.log /tmp/s66/nic-head-traces.log
python3 bench/results/2026-11-29-nvidia-h200-435f3ff-nic-link-whole-rounds/tracepoints.py /tmp/nic-head-traced.log send_end,fwd_started,fwd_summed,fwd_put,nic_first_put,reduce_end,nic_last_put,reduce_done 3 2>&1 | grep -i combine | head -4
bench ptr-head-traced .device/moelink $HEAD_COMMIT 3 ptr MOELINK_HT_TRACE=1
cp /tmp/ptr-head-traced.log /tmp/s66/ptr-head-traces.log
python3 bench/results/2026-11-29-nvidia-h200-435f3ff-nic-link-whole-rounds/tracepoints.py /tmp/ptr-head-traced.log send_end,fwd_end,reduce_done,reduce_end 2 2>&1 | grep -i combine | head -4
tar -C /tmp -czf $OUT/call66.tgz s66
