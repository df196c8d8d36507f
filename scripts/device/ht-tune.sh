#!/usr/bin/env bash
# Runs THERE (carry [".device"]): the HT release-batch experiment, in one call of about 6 minutes.
#   1. the HT GPU tests (moelink.test.ht, 4 GPUs): bitwise equal to the host backend, before anything is timed;
#   2. a short HT soak (thread mode, ht + ht-cached, small and large T) to catch a weakened memory ordering;
#   3. the sweep: EP4, 4096 tokens, hidden 7168, top-8 of 256, 24 SMs, BF16 and FP8, over the rows a sender
#      warp releases per fence (MOELINK_HT_RELEASE_BATCH) and the sender/receiver block split.
# Writes $OUT/ht-tune.json (records tagged with batch and split), $OUT/ht-tune-log.txt, $OUT/soak-*.json and
# prints a summary table last. Knobs: BATCHES, SPLITS ("dispatch_senders:combine_senders" ...), SOAK_S.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moelink-out}
mkdir -p "$OUT"
BIN=/tmp/moelink-device/moelink
mkdir -p /tmp/moelink-device && cp .device/moelink "$BIN" && chmod +x "$BIN"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MOELINK_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt 2>/dev/null)
export MOELINK_CACHE_DIR=/tmp/moelink-jit
LOG=$OUT/ht-tune-log.txt
: > "$LOG"
summary=$OUT/summary.txt
: > "$summary"
BATCHES=${BATCHES:-"1 2 4 8 16"}
SPLITS=${SPLITS:-"8:12 10:12 12:12 8:8 8:16"}
SOAK_S=${SOAK_S:-25}

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    start=$SECONDS
    (cd crates/moelink && MOELINK_TEST_CUDA=1 MOELINK_TEST_GPUS=4 timeout --kill-after=10 200 ../../.device/tests/moelink.test.ht) >> "$LOG" 2>&1
    echo "tests moelink.test.ht rc=$? $((SECONDS - start))s $(grep -E '^test result' "$LOG" | tail -n1)" | tee -a "$summary"
fi
for tm in 32 1024; do
    start=$SECONDS
    timeout --kill-after=10 $((SOAK_S + 60)) "$BIN" soak --backend cuda --families ht,ht-cached --t-max $tm --rounds 100000 \
        --time-budget-s "$SOAK_S" --json "$OUT/soak-t$tm.json" >> "$LOG" 2>&1
    echo "soak ht,ht-cached t-max $tm rc=$? $((SECONDS - start))s $(grep -E 'mismatch' "$LOG" | tail -n1)" | tee -a "$summary"
done

tmp=$(mktemp -d)
run_case() {  # run_case BATCH DSEND CSEND
    MOELINK_HT_RELEASE_BATCH=$1 MOELINK_HT_DISPATCH_SEND_BLOCKS=$2 MOELINK_HT_COMBINE_SEND_BLOCKS=$3 timeout 90 "$BIN" bench \
        --mode ht --dtype all --num-sms 24 --reps 10 --warmup 2 --no-host-check --json "$tmp/b$1-d$2-c$3.json" >> "$LOG" 2>&1
}
for b in $BATCHES; do run_case "$b" 8 12; done
for s in $SPLITS; do for b in 4 8; do run_case "$b" "${s%%:*}" "${s##*:}"; done; done
python3 - "$tmp" "$OUT/ht-tune.json" <<'PY' | tee -a "$summary"
import glob, json, os, sys
out, rows = [], {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    b, d, c = (int(x[1:]) for x in os.path.basename(f)[:-5].split("-"))
    for r in json.load(open(f)):
        r["release_batch"], r["dispatch_send_blocks"], r["combine_send_blocks"] = b, d, c
        out.append(r)
        key = (b, d, c)
        name = f"{r.get('op')} {r.get('dtype', '')}".strip()
        rows.setdefault(key, {})[name] = r.get("time_us", {}).get("median") if isinstance(r.get("time_us"), dict) else r.get("time_us")
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(f"{len(out)} records -> {sys.argv[2]}")
cols = sorted({n for v in rows.values() for n in v})
print("batch dsend csend | " + " | ".join(cols))
for k in sorted(rows):
    print(f"{k[0]:5} {k[1]:5} {k[2]:5} | " + " | ".join(str(rows[k].get(c)) for c in cols))
PY
echo "== summary"
cat "$summary"
