#!/usr/bin/env bash
# Runs HERE after a device call: copies what came back into bench/results/<date>-<gpus>x<device>-<commit>/
# so it can be committed.
#
#   scripts/device/collect.sh <folder the device tool returned (its files_at)>
#
# Copies the JSON results (bench.json, nvlink.json, ...) plus summary.md and env.txt (provenance). The
# folder name comes from the first JSON record (date, GPU count and name, commit); pass --with-log to
# copy log.txt as well.
set -euo pipefail
with_log=0
args=()
for a in "$@"; do
    case $a in
        --with-log) with_log=1 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) args+=("$a") ;;
    esac
done
if [ ${#args[@]} -ne 1 ] || [ ! -d "${args[0]}" ]; then
    echo "usage: scripts/device/collect.sh [--with-log] <folder returned by the device run>" >&2
    exit 1
fi
src=${args[0]}
cd "$(dirname "$0")/../.."

shopt -s nullglob
jsons=("$src"/*.json "$src"/*/*.json)
if [ ${#jsons[@]} -eq 0 ]; then
    echo "error: no JSON results in $src (did the bench/nvlink steps run? see its summary.md / log.txt)" >&2
    exit 1
fi
name=$(python3 - "${jsons[@]}" <<'PY'
import json, re, sys
for path in sys.argv[1:]:
    try:
        recs = json.load(open(path))
    except Exception:
        continue
    if isinstance(recs, list) and recs:
        r = recs[0]
        date = str(r.get("date", "unknown"))[:10]
        dev = re.sub(r"[^a-z0-9]+", "-", str(r.get("device", "unknown")).lower()).strip("-")
        gpus = r.get("gpus") or 0
        dev = f"{gpus}x{dev}" if gpus else dev
        commit = re.sub(r"[^A-Za-z0-9-]+", "", str(r.get("commit", "unknown")))
        print(f"{date}-{dev}-{commit}")
        break
else:
    print("")
PY
)
if [ -z "$name" ]; then
    echo "error: none of the JSON files in $src holds a list of records" >&2
    exit 1
fi
dest=bench/results/$name
mkdir -p "$dest"
for f in "${jsons[@]}"; do
    cp "$f" "$dest/"
done
for f in summary.md env.txt; do
    [ -f "$src/$f" ] && cp "$src/$f" "$dest/"
done
if [ "$with_log" = 1 ] && [ -f "$src/log.txt" ]; then
    cp "$src/log.txt" "$dest/"
fi
echo "copied into $dest:"
ls -l "$dest"
