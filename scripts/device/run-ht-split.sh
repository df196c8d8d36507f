#!/usr/bin/env bash
# Runs THERE: HT dispatch/combine at DeepEP's shape (EP4, 4096 tokens, hidden 7168, top-8 of 256, BF16, 24 SMs)
# with different sender/receiver block splits, to measure which role bounds the time. Writes one JSON list
# (records tagged with the split) to $OUT/<name>.json. Usage: bash scripts/device/run-ht-split.sh [name]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moelink-out}
name=${1:-ht-split}
BIN=/tmp/moelink-device/moelink
[ -x "$BIN" ] || { mkdir -p /tmp/moelink-device && cp .device/moelink "$BIN" && chmod +x "$BIN"; }
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MOELINK_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt 2>/dev/null)
tmp=$(mktemp -d)
# dispatch senders / combine senders out of 24 blocks (defaults: 12 / 8)
for split in "6 4" "12 8" "18 12" "12 16" "8 12"; do
    set -- $split
    echo "== split: dispatch senders $1, combine senders $2"
    MOELINK_HT_DISPATCH_SEND_BLOCKS=$1 MOELINK_HT_COMBINE_SEND_BLOCKS=$2 timeout 60 "$BIN" bench --mode ht --dtype bf16 \
        --num-sms 24 --reps 10 --warmup 2 --no-host-check --json "$tmp/d$1-c$2.json" 2>&1 | grep -E "^ht +(dispatch|combine)"
done
python3 - "$tmp" "$OUT/$name.json" <<'PY'
import glob, json, os, sys
out = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d, c = os.path.basename(f)[:-5].split("-")
    for r in json.load(open(f)):
        r["dispatch_send_blocks"], r["combine_send_blocks"] = int(d[1:]), int(c[1:])
        out.append(r)
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(f"{len(out)} records -> {sys.argv[2]}")
PY
