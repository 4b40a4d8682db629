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
# qkv_front builds that differ from the planned ones only in ring depth (3), PDL trigger or L2 prefetch
# (the GPU tests check that none changes a single bit: tests/test_gpu_qkv_front.py _alternatives), and in
# k_rotate (a different summation order, checked against fp64).
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python - <<'PY'
import dataclasses
from musekern.config import load_config
from musekern.targets import get_target
from musekern.variants import plan_model
for e in plan_model(load_config(), [get_target("h200")]):
    if e.kernel == "qkv_front" and e.variant.n in (2176, 4352):  # the bit-identity tests' alternatives
        print(dataclasses.replace(e.variant, stages=3).label)
        print(dataclasses.replace(e.variant, trigger="late" if e.variant.trigger == "early" else "early").label)
        print(dataclasses.replace(e.variant, l2_prefetch=32 if e.variant.l2_prefetch == 0 else 0).label)
    if e.kernel == "qkv_front":  # test_rotated_k_order_is_correct_and_deterministic: k_rotate 0, 1, 3
        for rot in (0, 1, 3):
            print(dataclasses.replace(e.variant, k_rotate=rot).label)
        # test_other_warp_split_is_correct_deterministic_and_ring_independent: the other split, 2 depths
        other = dataclasses.replace(e.variant, warp_split="k" if e.variant.warp_split == "rows" else "rows")
        print(other.label)
        print(dataclasses.replace(other, stages=3).label)
PY
)
# the ring-depth / k_split sweep of bench/sweep_variants.py (issue 5's levers)
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python bench/sweep_variants.py --print-labels)
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
