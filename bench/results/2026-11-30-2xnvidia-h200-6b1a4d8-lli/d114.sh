#!/usr/bin/env bash
# Call 114 (2 x H200, issue 29/31): where the LL dispatch's time goes, 6b7cc55's kernels: traces of the
# one-node LL at EP2, the across-nodes LL at 2x1 over ptr (thread mode) and over nvshmem (processes).
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s114; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
for i in 1 2; do
timeout -k 5 60 .device/moelink bench --mode ll --ranks 2 --reps 30 --ll-trace --json $S/ll-ep2-$i.json > $S/ll-ep2-$i.log 2>&1
echo "ll ep2 rc=$? at $(el)"; grep -E "^ll " $S/ll-ep2-$i.log | cut -c1-100
timeout -k 5 60 .device/moelink bench --mode ll --ranks 2 --topology 2x1 --transport ptr --reps 30 --ll-trace --json $S/lli-ptr-$i.json > $S/lli-ptr-$i.log 2>&1
echo "lli ptr rc=$? at $(el)"; grep -E "^ll " $S/lli-ptr-$i.log | cut -c1-100
done
MOELINK_LL_TRACE=1 STEPS=procbench PROCBENCH_TRANSPORTS="nvshmem" PROCBENCH_ARGS="--mode ll --reps 30" T_PROCBENCH=100 BUDGET_S=110 \
  OUT=/tmp/o114 W=/tmp/w114 bash scripts/device/run.sh > $S/procbench.log 2>&1
echo "procbench rc=$? at $(el)"; grep -E "^ll " $S/procbench.log | cut -c1-100
cp /tmp/o114/*.json $S/ 2>/dev/null
python3 scripts/ll-trace-points.py $S/*.json > $S/points.txt 2>&1; cat $S/points.txt | cut -c1-400
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call114.tgz s114
