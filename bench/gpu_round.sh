#!/usr/bin/env bash
# One whole GPU round on the H200 machine (no cutlass there): the GPU tests against the carried cache,
# results JSON (commit, device) to $OUT (or bench/results/), a short table last.
# Device call:  bash bench/gpu_round.sh [pytest -k expr]     with carry [".musekern-cache", ".whl"]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
NAME=${GPU_ROUND_NAME:-gpu-tests}
KEXPR=${1:-}
python3 -m pytest -m gpu -q -o junit_family=xunit1 --timeout=120 --timeout-method=thread -p no:cacheprovider ${KEXPR:+-k "$KEXPR"} \
  --junitxml "$DEST/$NAME.junit.xml" ${GPU_TESTS:-tests} 2>&1 | tail -n 40
rc=${PIPESTATUS[0]}
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no python3 bench/sanitize_qkv_front.py \
      > "$DEST/sanitizer-$tool.log" 2>&1
    echo "sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$DEST/sanitizer-$tool.log" | tail -1)"
  done
fi
python3 bench/gpu_results.py "$DEST/$NAME.junit.xml" "$DEST/$NAME.json"
exit $rc
