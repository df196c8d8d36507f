#!/usr/bin/env bash
# Call 115 (2 x H200, issue 29): the internode LL dispatch. head = 6b1a4d8 (chunks stored from registers into
# the destinations, route in two passes) on d686101 (receive loads one item ahead); base = 6b7cc55.
# 1. ll_internode_gpu tests, LL soak 2x2 emu-nic, LL kill-a-rank (emu-nic, nvshmem). 2. A/B 2x1 over ptr, traced,
# 3 rounds alternating base / d686101 / head. 3. token sweep base/head. 4. NVSHMEM processes, LL, base/head x2.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s115; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo $1;; esac; }
nvidia-smi -L > $S/gpus.txt
STEPS=internode INTERNODE_STEPS="ll soak htchaos" SOAK_S=40 HT_CHAOS_RUNS="ll-dispatch ll-combine" T_INTERNODE=230 BUDGET_S=240 \
  OUT=/tmp/o115i W=/tmp/w115i bash scripts/device/run.sh > $S/internode.log 2>&1
echo "internode rc=$? at $(el)"; cat /tmp/o115i/summary.txt 2>/dev/null | tail -25
cp /tmp/o115i/results.tgz $S/internode-results.tgz 2>/dev/null
ll() { name=$1; w=$2; shift 2
  env MOELINK_COMMIT=$(cm $w) timeout -k 5 60 $(bin $w) bench --mode ll --ranks 2 --topology 2x1 --transport ptr --reps 30 --ll-trace --json $S/$name.json "$@" > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ll " $S/$name.log | awk '{printf " %s %s %s |", $2, $3, $4}'
  python3 scripts/ll-trace-points.py $S/$name.json | grep "back to back (DeepEP" | sed 's/.*method)://' ; }
ll checked-head head
for i in 1 2 3; do for w in 6b7cc55 d686101 head; do ll $w-$i $w --no-host-check; done; done
echo "ab done at $(el)"
for w in 6b7cc55 head; do ll tok-$w $w --no-host-check --tokens 1,16,64,256; grep -E "^ll " $S/tok-$w.log | cut -c1-90; done
echo "sweep done at $(el)"
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
n=0
for w in 6b7cc55 head 6b7cc55 head; do
  mkdir -p /tmp/pb && cp $(bin $w) /tmp/pb/moelink-$w && chmod +x /tmp/pb/moelink-$w
  n=$((n + 1))
  env NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1 \
    MOELINK_LL_TRACE=1 MOELINK_COMMIT=$(cm $w) LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MOELINK_CACHE_DIR=/tmp/moelink-jit \
    timeout -k 5 90 torchrun --standalone --nproc_per_node=2 --no-python /tmp/pb/moelink-$w bench --process --backend cuda --ranks 2 --topology 2x1 \
    --transport nvshmem --mode ll --reps 30 --json $S/procbench-nvshmem-$w-$n.json > $S/procbench-$w-$n.log 2>&1
  echo "procbench $w rc=$? at $(el)"; grep -E "^ll " $S/procbench-$w-$n.log | cut -c1-90
done
python3 scripts/ll-trace-points.py $S/*-1.json $S/procbench-nvshmem-*.json > $S/points.txt 2>&1
grep -E "dispatch EP2 T=128 kernel:|back-to-back dispatch" $S/points.txt | cut -c1-330
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call115.tgz s115
