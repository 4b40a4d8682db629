#!/usr/bin/env bash
# The issue-5 benchmark in ONE device call on the H200 (no cutlass there): qkv_front chain / after-norm /
# isolated vs copy bandwidth, cuBLAS and the unfused chain; qk_norm; host costs. JSON + PNG to $OUT
# (or bench/results/), progress on stderr, the table last on stdout. Expected: ~1-3 minutes (< 9 min).
# Device call:  bash bench/gpu_bench.sh [musekern bench options, e.g. --quick]   carry [".musekern-cache", ".whl"]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MUSEKERN_CACHE_DIR="$PWD/.musekern-cache"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
nvidia-smi -L >&2 || true
# hard stop well under the 10-minute device limit, so whatever was written still comes back
timeout 530 python3 -m musekern.cli.bench_cmd --out "$DEST" "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu_bench.sh: TIMEOUT after 530 s" >&2
exit $rc
