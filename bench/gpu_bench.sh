#!/usr/bin/env bash
# The issue-5 benchmark in ONE device call on the H200 (no cutlass there): qkv_front chain / after-norm /
# isolated vs copy bandwidth, cuBLAS and the unfused chain; qk_norm; host costs. JSON + PNG to $OUT
# (or bench/results/), progress on stderr, the table last on stdout. Expected: ~1-3 minutes (< 9 min).
# Device call:  bash bench/gpu_bench.sh [bench.harness options, e.g. --quick]   carry [".musekern-cache", ".whl"]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# hard stop well under the 10-minute device limit, so whatever was written still comes back
timeout "${BENCH_TIMEOUT:-530}" python3 -m bench.harness --out "$DEST" "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu_bench.sh: TIMEOUT after ${BENCH_TIMEOUT:-530} s" >&2
exit $rc
