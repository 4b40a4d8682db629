# Round 66 (H100): the W8A8 plan (branch issue30-w8a8): sanitizers on its builds, the e4m3 front GPU tests, w8_bench
source bench/device_env.sh
SECONDS=0
for tool in memcheck racecheck synccheck; do
  timeout 70 compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no \
    python3 bench/sanitize_qkv_front.py --w8a8-only > $OUT/san-$tool.log 2>&1 &
done
timeout 70 python3 -m pytest -m gpu -q tests/test_gpu_qkv_front.py -k "fp8_weight_front or fp8_weight_graph" \
  -o junit_family=xunit1 --junitxml=$OUT/w8-gpu-tests.xml 2>&1 | tail -n 6; echo "tests t=$SECONDS"
wait; grep -h "ERROR SUMMARY\|launches ran\|Error" $OUT/san-*.log | head -n 8; echo "san t=$SECONDS"
timeout 50 python3 bench/w8_bench.py --gemm-ms '' --out $OUT/h100-w8-bench.json 2>/tmp/w8.log | tail -n 20
grep -E "ok=False" /tmp/w8.log | head -n 4; echo "all t=$SECONDS"
