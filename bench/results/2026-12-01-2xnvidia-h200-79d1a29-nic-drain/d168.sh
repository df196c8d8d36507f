#!/usr/bin/env bash
# Call 168 (issue 29, on 2 GPUs): head = 79d1a29's kernels (compact messages over the emulated NIC, every chunk
# in forwarder units over a NIC, the NIC blocks' drain check a lane a QP); base = ddd1507 (.device/exp/moelink-base).
# 1. 2x1 over emu-nic at 50 GB/s, a GPU per rank, head checked, base / head alternated 3 rounds; over ptr 2
# rounds; 2x2 over emu-nic (two ranks a GPU). 2. NVSHMEM processes 2x1, base / head, 1 round.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32 MOELINK_COMMIT=$(cat .device/COMMIT)
S=/tmp/s168; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
bin() { case $1 in head) echo .device/moelink;; *) echo .device/exp/moelink-$1;; esac; }
cm() { case $1 in head) cat .device/COMMIT;; *) echo ddd1507;; esac; }
nvidia-smi -L > $S/gpus.txt
ngpu=$(wc -l < $S/gpus.txt)
b() { name=$1; w=$2; tr=$3; shift 3
  timeout -k 5 150 env MOELINK_COMMIT=$(cm $w) MOELINK_CACHE_DIR=/tmp/jit168-$w "$@" $(bin $w) bench --mode ht --json $S/$name.json $BARGS --transport $tr > $S/$name.log 2>&1
  printf "%-16s rc=%s:" $name $?; grep -E "^ht " $S/$name.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo; }
if [ "$ngpu" -ge 2 ]; then
  NIC=emu-nic:rate=50,reorder=0,nic-blocks=16
  BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10" b nic-head-checked head $NIC
  BARGS="--ranks 2 --topology 2x1 --dtype all --reps 10 --no-host-check"
  for i in 1 2 3; do for w in base head; do b nic-$w-$i $w $NIC; done; done
  for i in 1 2; do for w in base head; do b ptr-$w-$i $w ptr; done; done
  BARGS="--ranks 4 --topology 2x2 --dtype all --reps 10 --no-host-check"
  for w in base head; do b nic22-$w $w $NIC; done
  echo "2-GPU A/B done at $(el)"
fi
nv=$(python3 -c 'import importlib.util; s = importlib.util.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
share=()
if [ "$ngpu" -lt 2 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps168-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps168-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
  share=(env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50)
fi
for i in 1; do for w in base head; do
  chk=--no-host-check; [ $w = head ] && [ $i = 1 ] && chk=
  mkdir -p /tmp/pb && cp $(bin $w) /tmp/pb/moelink-$w && chmod +x /tmp/pb/moelink-$w
  "${share[@]}" env NVSHMEM_HOME=$nv CUDA_HOME=/usr/local/cuda NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_DISABLE_NCCL=1 \
    MOELINK_COMMIT=$(cm $w) LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} MOELINK_CACHE_DIR=/tmp/moelink-jit-$w \
    timeout -k 5 100 torchrun --standalone --nproc_per_node=2 --no-python /tmp/pb/moelink-$w bench --process --backend cuda --ranks 2 --topology 2x1 \
    --transport nvshmem --mode ht --reps 10 $chk --json $S/procbench-nvshmem-$w-$i.json > $S/procbench-$w-$i.log 2>&1
  printf "%-18s rc=%s:" procbench-$w-$i $?; grep -E "^ht " $S/procbench-$w-$i.log | awk '{printf " %s %s %s (%s) |", $2, $3, $4, $8}'; echo
done; done
if [ "$ngpu" -lt 2 ]; then echo quit | nvidia-cuda-mps-control; echo "MPS daemon quit"; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi
echo "nvshmem done at $(el)"
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call168.tgz s168
