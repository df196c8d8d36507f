#!/usr/bin/env bash
# Runs THERE (carry [".device"]): where the HT time goes, measured by taking one role's data movement away.
#   1. (optional, SOAK_BINS) a short soak at T <= 1024 with each listed stress binary/batch, to tell a
#      regression from an older fault: "path:batch ..." (e.g. ".device/moelink-stress:4 .device/moelink-old:1";
#      a build from before the stress binary existed soaks with its `moelink soak`: name that binary);
#   2. EP4, 4096 tokens, hidden 7168, top-8 of 256, 24 SMs, BF16 + FP8 dispatch and combine, for each
#      MOELINK_HT_TIMING_EXPERIMENT in EXPERIMENTS (0: real; 1: receivers/reducers move no payload;
#      2: senders store no remote payload; 3: both, i.e. protocol only) and each split in SPLITS
#      ("dispatch:combine" sender blocks) at NUM_SMS SMs (default 24); cached dispatches as "... cached".
# Writes $OUT/ht-roles.json (records tagged), $OUT/ht-roles-log.txt, soak JSON, and a table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moelink-out}
mkdir -p "$OUT" /tmp/moelink-device
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MOELINK_COMMIT=$(sed -n 's/^commit: //p' .device/manifest.txt 2>/dev/null)
export MOELINK_CACHE_DIR=/tmp/moelink-jit
LOG=$OUT/ht-roles-log.txt
: > "$LOG"
summary=$OUT/summary.txt
: > "$summary"
EXPERIMENTS=${EXPERIMENTS:-"0 1 2 3"}
SPLITS=${SPLITS:-"8:12 10:12"}
BATCH=${BATCH:-4}
NUM_SMS=${NUM_SMS:-24}
SOAK_S=${SOAK_S:-20}
BIN=/tmp/moelink-device/moelink
cp .device/moelink "$BIN" && chmod +x "$BIN"

i=0
for spec in ${SOAK_BINS:-}; do
    i=$((i + 1))
    path=${spec%%:*} batch=${spec##*:}
    cp "$path" "/tmp/moelink-device/soak$i" && chmod +x "/tmp/moelink-device/soak$i"
    start=$SECONDS
    # Either binary takes the same soak options.
    MOELINK_HT_RELEASE_BATCH=$batch timeout --kill-after=10 $((SOAK_S + 60)) "/tmp/moelink-device/soak$i" soak --backend cuda \
        --families ht,ht-cached --t-max 1024 --rounds 100000 --time-budget-s "$SOAK_S" --json "$OUT/soak-$i.json" >> "$LOG" 2>&1
    rc=$?
    echo "soak $path batch $batch (T<=1024, ht+ht-cached): rc=$rc $((SECONDS - start))s: $(grep -E '^soak: ' "$LOG" | tail -n1)" | tee -a "$summary"
done

tmp=$(mktemp -d)
for s in $SPLITS; do
    for x in $EXPERIMENTS; do
        MOELINK_HT_TIMING_EXPERIMENT=$x MOELINK_HT_RELEASE_BATCH=$BATCH MOELINK_HT_DISPATCH_SEND_BLOCKS=${s%%:*} \
            MOELINK_HT_COMBINE_SEND_BLOCKS=${s##*:} timeout 90 "$BIN" bench --mode ht --dtype all --num-sms "$NUM_SMS" --reps 10 \
            --warmup 2 --no-host-check --json "$tmp/x$x-d${s%%:*}-c${s##*:}.json" >> "$LOG" 2>&1
    done
done
python3 - "$tmp" "$OUT/ht-roles.json" "$BATCH" <<'PY' | tee -a "$summary"
import glob, json, os, sys
out, rows = [], {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    x, d, c = (int(v[1:]) for v in os.path.basename(f)[:-5].split("-"))
    for r in json.load(open(f)):
        r.update(timing_experiment=x, release_batch=int(sys.argv[3]), dispatch_send_blocks=d, combine_send_blocks=c)
        if x:
            r["correct"] = False
            r["status"] = "timing experiment (results wrong by design)"
        out.append(r)
        rows.setdefault((d, c, x), {})[f"{r['op']} {r['dtype']}"] = round(r["time_us"], 1)
        if r.get("cached_us") is not None:
            rows[(d, c, x)][f"{r['op']} {r['dtype']} cached"] = round(r["cached_us"], 1)
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(f"{len(out)} records -> {sys.argv[2]}  (experiment 0 real, 1 no copy-out, 2 no remote payload, 3 neither)")
cols = sorted({n for v in rows.values() for n in v})
print("dsend csend exp | " + " | ".join(cols))
for k in sorted(rows):
    print(f"{k[0]:5} {k[1]:5} {k[2]:3} | " + " | ".join(str(rows[k].get(c)) for c in cols))
PY
echo "== summary"
cat "$summary"
