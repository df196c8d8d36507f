#!/usr/bin/env bash
# Call 161 (2 x H200, a GPU per rank; issue 31): the suite's HT curves (4096 tokens uniform and skewed at 24 SMs,
# the SM sweep 8-64, the token sweep 512-16384) with 1ee3baa's defaults (the releaser for the BF16 dispatch
# and the combine) against the old defaults in the same binary (MOELINK_HT_RELEASER=0
# MOELINK_HT_RELEASE_BATCH=4), alternated.
set -u
cd "$(dirname "$0")/.."
export MOELINK_COMMIT=$(cat .device/COMMIT) NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
S=/tmp/s161; mkdir -p $S
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L > $S/gpus.txt
suite() { name=$1; envs=$2
  env $envs timeout -k 5 250 .device/moelink bench --suite --mode ht --ranks 2 --reps 20 --json $S/$name.json > $S/$name.log 2>&1
  echo "$name rc=$? at $(el)"; }
suite suite-old "MOELINK_HT_RELEASER=0 MOELINK_HT_RELEASE_BATCH=4"
suite suite-head ""
python3 - "$S" <<'PY'
import sys, re
S = sys.argv[1]
def rows(name):
    out = {}
    for line in open(f"{S}/{name}.log"):
        f = line.split()
        if not f or f[0] != "ht": continue
        key = " ".join(f[1:-6]) if len(f) > 9 else " ".join(f[1:3])
        out.setdefault(key, []).append(line.rstrip())
    return out
o, h = rows("suite-old"), rows("suite-head")
for k in o:
    for a, b in zip(o[k], h.get(k, [])):
        print("old :", a); print("head:", b)
PY
echo "all done at $(el)"
tar -C /tmp -czf $OUT/call161.tgz s161
