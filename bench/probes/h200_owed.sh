# The H200 round issues 29 / 30 are owed (sourced by the round scripts after bench/device_env.sh, $OUT and SECONDS
# set): the whole GPU round with the sanitizers (gpu-tests.json), w8_bench (GEMM path at M = 64 / 1024),
# kv_fp8_bench.
SANITIZE=1 SAN_TIMEOUT=200 TEST_TIMEOUT=240 bash bench/gpu_round.sh > $OUT/round.txt 2>&1
echo "round rc=$? t=$SECONDS"; tail -n 14 $OUT/round.txt
rm -f $OUT/sanitizer-*.log $OUT/*.junit.xml  # folded into gpu-tests.json
timeout 60 python3 bench/w8_bench.py --gemm-ms 64,1024 --out $OUT/h200-w8-bench.json 2>/tmp/w8.log | tail -n 24
echo "w8 t=$SECONDS"; grep -h "ok=False" /tmp/w8.log | head -n 6; grep -A60 Traceback /tmp/w8.log | tail -n 2
timeout 90 python3 bench/kv_fp8_bench.py --out $OUT/h200-kv-fp8-bench.json 2>/tmp/kv.log | tail -n 22
echo "kv t=$SECONDS"; grep -h "Traceback\|Error" /tmp/kv.log | head -n 4
