#!/usr/bin/env bash
# Call 128 (2 x H200; issue 31), head = 10504fe (LL and HT kernels of d40541a plus HT experiment bit 8).
# 1. DeepEP's test_low_latency / test_intranode and the host-cost bench, moelink beside DeepEP (Python API).
# 2. .dv/ce_probe.py: the cached HT dispatch with the own rows' payload left out (bit 8) at 10-16 sender
#    blocks, alone and beside a torch D2D copy of the same bytes on a side stream.
# 3. LL (issue 31 item 3 for d40541a): skewed routing and 1x4 (two ranks a GPU), A/B against be3734e.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s128; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site128 .device/moelink-*.whl
PYTHONPATH=/tmp/site128 LD_LIBRARY_PATH=/usr/local/cuda/lib64 timeout -k 5 150 torchrun --standalone --nproc_per_node=2 \
  .dv/ce_probe.py $S/ce_probe.json > $S/ce_probe.log 2>&1
echo "ce_probe rc=$? at $(el)"; grep -E '^\{|profile' $S/ce_probe.log | cut -c1-260
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ll --reps 30 --ll-trace --json $S/$name.json "$@" > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ll " $S/$name.log | awk '{printf " %s %s %s %s |", $2, $3, $4, $5}'; echo; }
for i in 1 2; do for w in be3734e head; do ll skew-$w-$i $w --ranks 2 --no-host-check --routing skewed; done; done
for i in 1 2; do for w in be3734e head; do CUDA_DEVICE_MAX_CONNECTIONS=32 ll x4-$w-$i $w --ranks 4 --topology 1x4 --no-host-check; done; done
ll skew-checked head --ranks 2 --routing skewed
echo "ll done at $(el)"
STEPS=python PY_STEPS=hostcost HOSTCOST_REPEAT=0 HOSTCOST_ALTERNATE=0 T_PYTHON=230 BUDGET_S=240 \
  OUT=/tmp/o128p W=/tmp/w128p bash scripts/device/run.sh > $S/python.log 2>&1
echo "python rc=$? at $(el)"; grep -A14 "moelink / DeepEP\|== summary" $S/python.log | head -40
cp -r /tmp/w128p/python/. $S/ 2>/dev/null; cp /tmp/o128p/* $S/ 2>/dev/null; rm -f $S/results.tgz
grep -E "Best" $S/deepep-tests.log $S/deepep-baseline.log
grep -E "Dispatch \+ combine bandwidth|Dispatch bandwidth" $S/deepep-tests.log $S/deepep-baseline.log
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call128.tgz s128
