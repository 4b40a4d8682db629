#!/usr/bin/env bash
# Run HERE (CPU machine, build extra installed): build the cache the GPU round carries to the H200.
# Usage: bash bench/gpu_cache.sh [cache-dir]   (default .musekern-cache, an ignored folder)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the research harness: bench.harness, from the repository root
CACHE=${1:-.musekern-cache}
MK=".venv/bin/python -m musekern"
# the h200 plans (bench/same_cubins.py PLANS): the bundled model's; with an FP8 KV cache (issue 29,
# tests/test_gpu_kv_cache.py); with each e4m3 weight format (issue 30: tests/test_gpu_qkv_front.py's FP8-weight tests
# take them), and both FP8
while read -r kv wf; do
  $MK prepare --target h200 --kv-cache-dtype "$kv" --weight-format "$wf" --cache-dir "$CACHE" -j 2 >&2
done < <(.venv/bin/python bench/same_cubins.py --plans)
# qk_norm variants beyond the model's (head_dim 64): the GPU tests cover head_dim 128/256 and fp16, with one and
# four vectors per thread.
labels=()
for dt in bfloat16 float16; do for hd in 64 128 256; do for sc in False True; do for vpt in 1 4; do
  labels+=(--variant "qk_norm[dtype=$dt,has_scale=$sc,head_dim=$hd,vecs_per_thread=$vpt]")
done; done; done; done
# qkv_front builds that differ from the planned ones only in a lever that must not change a bit (ring depth,
# PDL trigger, trigger_ahead), and in the warp split (a different summation order, checked against fp64):
# tests/qkv_front_builds.py, which the GPU tests use too.
while read -r lbl; do labels+=(--variant "$lbl"); done < <(PYTHONPATH=tests .venv/bin/python - <<'PY'
from musekern.config import load_config
from musekern.targets import get_target
from musekern.plan import plan_model
from qkv_front_builds import gpu_test_builds
planned = [e.variant for e in plan_model(load_config(), [get_target("h200")]) if e.kernel == "qkv_front"]
for v in gpu_test_builds(planned):
    print(v.label)
PY
)
# the front above M = 16: the builds the rules pick for M = 17..64 on every shard (served or not), their
# same-bits / other-warp-split builds and the alternatives bench/front_large_m.py times beside them
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python bench/front_large_m.py labels)
# every qkv_epilogue build (the plan takes 1 and 2 vectors a thread; the GPU tests and the sanitizer run all four)
for vpt in 1 2 4 8; do labels+=(--variant "qkv_epilogue[vecs_per_thread=$vpt]"); done
# every FP8 qkv_epilogue build (tests/test_gpu_kv_cache.py runs all eight against the bf16 build of the same levers)
for vpt in 1 2 4 8; do for r in 1 2; do
  labels+=(--variant "qkv_epilogue[kv_cache_dtype=fp8_e4m3,rounds=$r,vecs_per_thread=$vpt]")
  labels+=(--variant "qkv_epilogue[rounds=$r,vecs_per_thread=$vpt]")
done; done
# the ring-depth / k_split sweep of bench/sweep_variants.py (issue 5's levers)
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python bench/sweep_variants.py --print-labels)
# the e4m3 and bf16 fronts bench/w8_bench.py times side by side on every shard (issue 30)
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python bench/w8_labels.py)
# the e4m3 builds of 4 and 8 token tiles bench/probes/w8_wide.py measures (M 17-64: not planned yet)
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python bench/probes/w8_wide.py labels)
$MK prepare --target h200 --cache-dir "$CACHE" -j 2 "${labels[@]}" >&2
# What the results files cite: the commit the cache was built from.
.venv/bin/python - "$CACHE" <<'PY'
import json, sys
from bench.harness.report import git_state
info = git_state()
json.dump(info, open(f"{sys.argv[1]}/BUILD_INFO.json", "w"))
print(f"cache {sys.argv[1]} built from {info['commit']}{' (dirty)' if info['dirty'] else ''}")
PY
