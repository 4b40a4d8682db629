#!/usr/bin/env bash
# One qkv_epilogue round on the H200 machine (no cutlass there), sized for a 4-minute device call:
#   - tests/test_gpu_qkv_epilogue.py, with compute-sanitizer memcheck / racecheck / synccheck running beside it on
#     bench/sanitize_qkv_epilogue.py (three processes: the tests need the GPU's time, the sanitizers its patience);
#   - then bench/epilogue_bench.py alone on the GPU (timing).
# Results to $OUT (or bench/results/): h200-epilogue-gpu.json (tests + sanitizers, commit, device),
# h200-epilogue-bench.json, the sanitizer and bench logs, tables.txt (printed last).
# Here:   bash bench/epilogue_cache.sh   (builds .musekern-cache), then carry it with the tree (HELPERS.md)
# There:  bash bench/epilogue_gpu.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
compute-sanitizer --version | tail -n 1
for tool in memcheck racecheck synccheck; do
  timeout "${SAN_TIMEOUT:-80}" compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no \
    python3 bench/sanitize_qkv_epilogue.py > "$DEST/sanitizer-$tool.log" 2>&1 &
done
timeout "${TEST_TIMEOUT:-80}" python3 -m pytest -q -p no:cacheprovider -p no:randomly -o junit_family=xunit1 \
  --junitxml /tmp/epilogue-gpu.junit.xml tests/test_gpu_qkv_epilogue.py 2>&1 | tail -n 30
rc=${PIPESTATUS[0]}
wait
python3 bench/gpu_results.py /tmp/epilogue-gpu.junit.xml "$DEST/h200-epilogue-gpu.json" > "$DEST/tables.txt"
timeout "${BENCH_TIMEOUT:-100}" python3 bench/epilogue_bench.py --out "$DEST" ${BENCH_ARGS:-} 2> "$DEST/epilogue-bench.log" \
  >> "$DEST/tables.txt"
echo "bench rc=$?"
tail -n 4 "$DEST/epilogue-bench.log"
cat "$DEST/tables.txt"
exit $rc
