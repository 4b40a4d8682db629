#!/usr/bin/env bash
# One whole GPU round on the H200 machine (no cutlass there): the GPU tests against the carried cache, results JSON
# (commit, device) to $OUT (or bench/results/), a short table last.
# Device call:  bash bench/gpu_round.sh [pytest -k expr]     with carry [".musekern-cache", ".whl"]
# SANITIZE=1: compute-sanitizer memcheck / racecheck / synccheck over bench/sanitize_qkv_front.py (every front
# build and the GEMM + epilogue path) and bench/sanitize_qkv_epilogue.py (every epilogue build), six processes
# beside the tests (the tests need the GPU's time, the sanitizers their patience).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
NAME=${GPU_ROUND_NAME:-gpu-tests}
KEXPR=${1:-}
if [ "${SANITIZE:-0}" = 1 ]; then
  for script in qkv_front qkv_epilogue; do for tool in memcheck racecheck synccheck; do
    # racecheck of the front script runs only the fused front's M: on the GEMM + epilogue path it reports hazards
    # inside cuBLAS's own sm90 GEMM kernels (nvjet_*: 5 at 4f19417, none in musekern's), and excluding those kernels
    # by name makes the sanitizer itself fail; the epilogue's own script covers its kernel
    only=(); [ $tool = racecheck ] && [ $script = qkv_front ] && only=(--fused-only)
    timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no \
      python3 bench/sanitize_$script.py "${only[@]}" > "$DEST/sanitizer-$tool-$script.log" 2>&1 &
  done; done
fi
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu -q -o junit_family=xunit1 --timeout=150 --timeout-method=thread \
  -p no:cacheprovider -p no:randomly ${KEXPR:+-k "$KEXPR"} --junitxml "$DEST/$NAME.junit.xml" ${GPU_TESTS:-tests} 2>&1 \
  | tail -n 40
rc=${PIPESTATUS[0]}
wait
python3 bench/gpu_results.py "$DEST/$NAME.junit.xml" "$DEST/$NAME.json"
exit $rc
