#!/usr/bin/env bash
# Run HERE (CPU machine, build extra installed): every qkv_epilogue build (the planned ones and the rest of the
# vecs_per_thread x rounds sweep: musekern.kernels.qkv_epilogue.variant.all_builds) into the cache bench/epilogue_gpu.sh carries to the H200, with the commit they were built from.
# Usage: bash bench/epilogue_cache.sh [cache-dir]   (default .musekern-cache, an ignored folder)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the research harness: bench.harness, from the repository root
CACHE=${1:-.musekern-cache}
labels=()
while read -r lbl; do labels+=(--variant "$lbl"); done < <(.venv/bin/python -c "
from musekern.kernels.qkv_epilogue.variant import all_builds
print('\\n'.join(b.label for b in all_builds()))")
[ ${#labels[@]} -gt 0 ] || { echo "epilogue_cache.sh: no builds listed (musekern.kernels.qkv_epilogue.variant.all_builds failed?)" >&2; exit 1; }
.venv/bin/python -m musekern prepare --target h200 --cache-dir "$CACHE" -j 2 "${labels[@]}" >&2
.venv/bin/python - "$CACHE" <<'PY'
import json, sys
from bench.harness.report import git_state
info = git_state()
json.dump(info, open(f"{sys.argv[1]}/BUILD_INFO.json", "w"))
print(f"cache {sys.argv[1]} built from {info['commit']}{' (dirty)' if info['dirty'] else ''}")
PY
