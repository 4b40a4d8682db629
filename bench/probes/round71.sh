# Round 71 (branch issue30-x8-ahead): the W8A8 front reading x quantized ahead: x8_ahead (check + time against the
# builds main plans), the e4m3 GPU tests, the sanitizers on its builds
source bench/device_env.sh
SECONDS=0
for tool in memcheck racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool --print-limit 20 --report-api-errors no \
    python3 bench/probes/wg8_sanitize.py > $OUT/san-$tool.log 2>&1 &
done
timeout 80 python3 -m pytest -m gpu -q tests/test_gpu_qkv_front.py -k "fp8_weight" -o junit_family=xunit1 \
  --junitxml=$OUT/w8-gpu-tests.xml 2>&1 | tail -n 8; echo "tests t=$SECONDS"
wait; grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|launches ran" $OUT/san-*.log | head -n 8; echo "san t=$SECONDS"
timeout 120 python3 bench/probes/x8_ahead.py run 2>$OUT/x8_ahead.log | tail -n 18; echo "x8 t=$SECONDS"
grep -i "Traceback\|Error" $OUT/x8_ahead.log | head -n 4
