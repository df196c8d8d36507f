#!/usr/bin/env bash
# Call 56 (1 x H200: ranks share the GPU): the combine's forwarder warps share chunks in groups (d032d73).
# ht_internode, internode_gpu; HT 2x1 over the emulated NIC at 50 GB/s (16 blocks) and over ptr, 2x2 over
# ptr (4 ranks on the GPU), head against a69c618 in the same call; traced head; soaks 2x2 emu-nic (reordering)
# and 2x1 ptr; kill-a-rank in an HT dispatch and an HT combine, 4 processes under MPS, 2x2 emu-nic.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
HEAD_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt)
mkdir -p /tmp/s56
STEPS="tests" TEST_BINS="moelink.test.ht_internode moelink.test.internode_gpu" T_TESTS=150 BUDGET_S=160 OUT=/tmp/t56 W=/tmp/w56t \
  bash scripts/device/run.sh 2>&1 | grep -E "test result|FAILED|panicked" | head -8
bench() {  # label binary commit reps topology transport [env...]
  local label=$1 bin=$2 commit=$3 reps=$4 topo=$5 tr=$6; shift 6
  local ranks=$(( ${topo%x*} * ${topo#*x} ))
  timeout 120 env MOELINK_COMMIT=$commit MOELINK_CACHE_DIR=/tmp/jit56-$commit "$@" $bin bench --mode ht --ranks $ranks --topology $topo --reps $reps \
    --transport $tr --json "/tmp/s56/$label.json" > /tmp/$label.log 2>&1
  echo "$label rc=$?"
  python3 - "/tmp/s56/$label.json" "$label" <<'PY'
import json, sys
try: recs = json.load(open(sys.argv[1]))
except Exception as e: print(sys.argv[2], "no records", e); sys.exit()
for r in recs:
    print(sys.argv[2], r.get("op"), r.get("dtype"), r.get("status"), "time %.1f" % r.get("time_us", -1), "cached", r.get("cached_us"), "match", r.get("matches_host"), r.get("commit"))
PY
}
NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
BASE=.device/base/moelink-a69c618
bench nic-base $BASE a69c618 5 2x1 $NIC
bench nic-head .device/moelink $HEAD_COMMIT 5 2x1 $NIC
bench ptr-base $BASE a69c618 10 2x1 ptr
bench ptr-head .device/moelink $HEAD_COMMIT 10 2x1 ptr
bench ptr2x2-base $BASE a69c618 5 2x2 ptr
bench ptr2x2-head .device/moelink $HEAD_COMMIT 5 2x2 ptr
bench nic-head-traced .device/moelink $HEAD_COMMIT 3 2x1 $NIC MOELINK_HT_TRACE=1
cp /tmp/nic-head-traced.log /tmp/s56/nic-head-traces.log
python3 .dv/tracepoints.py /tmp/nic-head-traced.log send_end,chunk_put,recv_end,fwd_put,nic_first_put,nic_last_put,reduce_end 1
export MOELINK_COMMIT=$HEAD_COMMIT MOELINK_CACHE_DIR=/tmp/jit56-$HEAD_COMMIT
timeout 60 .device/moelink-stress soak --backend cuda --progress-s 200 --json "/tmp/s56/soak-2x1-ptr.json" --ranks 2 --topology 2x1 \
  --transport ptr --t-max 1024 --ht-round-tokens 128 --time-budget-s 30 > /tmp/s56b.log 2>&1; echo "soak 2x1 ptr rc=$?"
grep -E "^(ht|ll)|^soak|ERROR|buffers for" /tmp/s56b.log | cut -c1-250 | head -9
STEPS="reliability" RELIABILITY_STEPS="soak chaos" SOAK_S=45 \
  SOAK_ARGS="--ranks 4 --topology 2x2 --transport emu-nic:reorder=20,nic-blocks=3 --families ht,ht-cached --t-max 512 --ht-round-tokens 96" \
  RANKS=4 CHAOS_ARGS="--topology 2x2 --transport emu-nic" CHAOS_RUNS="ht-dispatch ht-combine" \
  T_RELIABILITY=240 BUDGET_S=250 OUT=/tmp/s56/r W=/tmp/w56r bash scripts/device/run.sh > /tmp/w56r.log 2>&1
grep -E "soak|rounds|mismatch|PASS|FAIL" /tmp/w56r/reliability/soak-log.txt 2>/dev/null | tail -6
grep -h "CHAOS_" /tmp/w56r/reliability/*.txt /tmp/w56r/reliability/*.log 2>/dev/null | cut -c1-200 | head -10
tail -6 /tmp/w56r.log
cp /tmp/w56r/reliability/reliability.json /tmp/w56r/reliability/soak.json /tmp/s56/ 2>/dev/null
cp /tmp/t56/summary.md /tmp/s56/tests-summary.md 2>/dev/null
tar -C /tmp -czf $OUT/call56.tgz s56
