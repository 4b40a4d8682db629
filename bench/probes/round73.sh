# Round 73: main's GPU tests on whichever card comes (the kernels' cubins are 8cac4dd's, bench/same_cubins.py); on an
# H200 also the round owed for issues 29 / 30: kv_fp8_bench and w8_bench (checks and fronts; no GEMM-path timing).
# Here: bash bench/gpu_cache.sh.  GPU (carry .musekern-cache, .whl): LIMIT=<seconds> bash bench/probes/round73.sh
source bench/device_env.sh
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
TEST_TIMEOUT=240 bash bench/gpu_round.sh > $OUT/round.txt 2>&1
echo "round rc=$? t=$SECONDS"; tail -n 14 $OUT/round.txt
rm -f $OUT/*.junit.xml  # folded into gpu-tests.json
if [[ $gpu == *H200* ]]; then
  timeout $(( (${LIMIT:-575} - SECONDS) / 2 )) python3 bench/kv_fp8_bench.py --out $OUT/h200-kv-fp8-bench.json \
    2>$OUT/kv.log | tail -n 22
  echo "kv t=$SECONDS"
  timeout $((${LIMIT:-575} - SECONDS)) python3 bench/w8_bench.py --gemm-ms '' --out $OUT/h200-w8-bench.json 2>$OUT/w8.log \
    | tail -n 24
  echo "w8 t=$SECONDS"; grep -h "Traceback\|ok=False" $OUT/kv.log $OUT/w8.log | head -n 6
fi
