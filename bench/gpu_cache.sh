#!/usr/bin/env bash
# Run HERE (CPU machine, build extra installed): build the cache the GPU round carries to the H200.
# Usage: bash bench/gpu_cache.sh [cache-dir]   (default .musekern-cache, an ignored folder)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${1:-.musekern-cache}
MK=".venv/bin/python -m musekern"
$MK prepare --target h200 --cache-dir "$CACHE" -j 2 >&2
# qk_norm variants beyond the model's (head_dim 64): the GPU tests cover head_dim 128/256 and fp16.
labels=()
for dt in bfloat16 float16; do for hd in 64 128 256; do for sc in False True; do
  labels+=(--variant "qk_norm[dtype=$dt,has_scale=$sc,head_dim=$hd]")
done; done; done
$MK prepare --target h200 --cache-dir "$CACHE" -j 2 "${labels[@]}" >&2
# What the results files cite: the commit the cache was built from.
python3 - "$CACHE" <<'PY'
import json, subprocess, sys
rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                            text=True).stdout.strip())
json.dump({"commit": rev, "dirty": dirty}, open(f"{sys.argv[1]}/BUILD_INFO.json", "w"))
print(f"cache {sys.argv[1]} built from {rev}{' (dirty)' if dirty else ''}")
PY
