#!/usr/bin/env bash
# Call 96 (2 x H200). Issue 31: where 1afec0f's dispatch receive spends its time (trace points recv_counted,
# recv_own), and the own rows before the peers' flags against after them (MOELINK_LL_EXPERIMENT=own_late, results
# right), alternating 3 times, with 7b09642 (base) and c93dba6 (exp) once each.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s96; mkdir -p $S; B=.device/moelink; A=.device/base/moelink; X=.device/exp/moelink
t0=$(date +%s)
nvidia-smi -L > $S/gpus.txt
ll() { name=$1; bin=$2; shift 2; timeout -k 5 45 $bin bench --mode ll --reps 30 --ll-trace --json $S/ll-$name.json "$@" > $S/ll-$name.log 2>&1
  echo "== ll $name rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^ll " $S/ll-$name.log | head -8; }
ll base $A --ranks 2; ll exp $X --ranks 2
for i in 1 2 3; do ll head-$i $B --ranks 2; MOELINK_LL_EXPERIMENT=own_late ll late-$i $B --ranks 2; done
echo "all done at $(( $(date +%s) - t0 )) s"
tar -C /tmp -czf $OUT/call96.tgz s96
