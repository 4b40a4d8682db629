#!/usr/bin/env bash
# Run HERE (CPU machine, build extra installed): build the cache the GPU round carries to the H200.
# Usage: bash bench/gpu_cache.sh [cache-dir]   (default .musekern-cache, an ignored folder)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${1:-.musekern-cache}
MK=".venv/bin/python -m musekern"
$MK prepare --target h200 --cache-dir "$CACHE" -j 2 >&2
# qk_norm variants beyond the model's (head_dim 64): the GPU tests cover head_dim 128/256 and fp16, with one and
# four vectors per thread.
labels=()
for dt in bfloat16 float16; do for hd in 64 128 256; do for sc in False True; do for vpt in 1 4; do
  labels+=(--variant "qk_norm[dtype=$dt,has_scale=$sc,head_dim=$hd,vecs_per_thread=$vpt]")
done; done; done; done
# qkv_front builds that differ from the planned ones only in a lever that must not change a bit (ring depth,
# PDL trigger, L2 prefetch, stash, trigger_ahead: same_bits_alternatives, compared bit for bit by the GPU
# tests), in k_rotate and in the warp split (different summation orders, checked against fp64).
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python - <<'PY'
import dataclasses
from musekern.config import load_config
from musekern.targets import get_target
from musekern.variants import plan_model
from musekern.variants.qkv_front import other_warp_split, same_bits_alternatives
for e in plan_model(load_config(), [get_target("h200")]):
    if e.kernel != "qkv_front":
        continue
    for alt in same_bits_alternatives(e.variant).values():
        print(alt.label)
    for rot in (0, 1, 3):  # test_rotated_k_order_is_correct_and_deterministic
        print(dataclasses.replace(e.variant, k_rotate=rot).label)
    other = other_warp_split(e.variant)  # test_other_warp_split_is_correct_deterministic_and_ring_independent
    print(other.label)
    print(same_bits_alternatives(other)["stages"].label)
PY
)
# the ring-depth / k_split sweep of bench/sweep_variants.py (issue 5's levers)
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python bench/sweep_variants.py --print-labels)
$MK prepare --target h200 --cache-dir "$CACHE" -j 2 "${labels[@]}" >&2
# What the results files cite: the commit the cache was built from.
.venv/bin/python - "$CACHE" <<'PY'
import json, sys
from musekern.bench.report import git_state
info = git_state()
json.dump(info, open(f"{sys.argv[1]}/BUILD_INFO.json", "w"))
print(f"cache {sys.argv[1]} built from {info['commit']}{' (dirty)' if info['dirty'] else ''}")
PY
