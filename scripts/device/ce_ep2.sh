#!/usr/bin/env bash
# Runs THERE, on a machine with two GPUs (device tool: kind nvidia-h200-x2, carry [".device", ".whl"], command
# `bash scripts/device/ce_ep2.sh`): the copy-engine path of the EP2 pair (docs/perf-notes.md, item 8;
# MOELINK_HT_CE_PIECES) over NVLink, everything issue 31 asks of it in one call, about 8 minutes:
#   1. scripts/device/ce_pair.py: the copy engines each way, in pieces, beside a 24-SM local copy;
#   2. moelink bench nvlink --sms 24: the SM pair copy the bounds are stated against;
#   3. the ht tests at two ranks with 4 pieces of any size (the tests' rows are small), and a 60 s ht / ht-cached
#      soak with 4 pieces;
#   4. moelink bench at EP2, the SM senders against 2 and 4 pieces, alternated 3 times, and a token sweep
#      (1, 512, 4096; uniform and skewed) both ways;
#   5. DeepEP's test_intranode.py against moelink with 4 pieces, and against DeepEP V1, through the python
#      step's hostcost sub-step (which needs .whl/: the wheel, DeepEP's wheel and tests; see steps/python.sh).
# Writes $OUT/ce_ep2.tgz (every log and JSON) and prints a summary last.
set -u
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 MOELINK_COMMIT=$(cat .device/COMMIT 2>/dev/null || echo unknown)
S=/tmp/ce_ep2; mkdir -p $S
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local s=$(date +%s); timeout -k 5 "$limit" "$@" > "$S/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s )) s" | tee -a $S/summary.txt; }
nvidia-smi -L > $S/gpus.txt
[ "$(wc -l < $S/gpus.txt)" -ge 2 ] || { echo "needs two GPUs: $(cat $S/gpus.txt)"; exit 2; }
step ce_pair 240 python3 scripts/device/ce_pair.py $S/ce-pair.json
step nvlink 120 .device/moelink bench nvlink --sms 24 --json $S/nvlink.json
step tests 150 env MOELINK_TEST_RANKS=2 MOELINK_HT_CE_PIECES=4 MOELINK_HT_CE_MIN_PIECE_BYTES=0 .device/tests/moelink.test.ht --include-ignored --test-threads=1 cuda
step soak 100 env MOELINK_HT_CE_PIECES=4 .device/moelink-stress soak --backend cuda --ranks 2 --families ht,ht-cached \
  --t-max 4096 --time-budget-s 60 --json $S/soak.json
B=(.device/moelink bench --mode ht --ranks 2 --dtype all --reps 20)
for i in 1 2 3; do
  step sm-$i 60 "${B[@]}" --json $S/sm-$i.json
  for p in 2 4; do step ce$p-$i 60 env MOELINK_HT_CE_PIECES=$p "${B[@]}" --json $S/ce$p-$i.json; done
done
step sm-sweep 90 "${B[@]}" --tokens 1,512,4096 --routing uniform,skewed --json $S/sm-sweep.json
step ce4-sweep 90 env MOELINK_HT_CE_PIECES=4 "${B[@]}" --tokens 1,512,4096 --routing uniform,skewed --json $S/ce4-sweep.json
MOELINK_HT_CE_PIECES=4 STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=220 BUDGET_S=230 \
  OUT=$S/python-out W=$S/python-w bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$?" | tee -a $S/summary.txt
echo "== done after $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/ce_ep2.tgz ce_ep2
tail -25 $S/ce_pair.log; grep -E "pair sm-stores +24" $S/nvlink.log
for f in $S/sm-1.log $S/ce2-1.log $S/ce4-1.log $S/sm-2.log $S/ce2-2.log $S/ce4-2.log $S/sm-3.log $S/ce2-3.log $S/ce4-3.log; do
  echo "$(basename $f)"; grep -E "^ht " $f; done
grep -E "soak:|mismatch" $S/soak.log | tail -2
grep -hE "\[tuning\] Best|passed" $S/python-w/python/deepep-tests.log $S/python-w/python/deepep-baseline.log 2>/dev/null | head -20
cat $S/summary.txt
