# Round 72 (either card; this session's device time allows one call): on an H200 the round owed at main for issues
# 29 / 30 (the GPU tests, kv_fp8_bench, w8_bench's checks and fronts); on an H100 the x-ahead probe at
# e11fe57 (branch issue30-x8-ahead: x_quant triggers before its wait), carried as .whl/x8tree with its own cache.
# Here: bash bench/gpu_cache.sh; git archive e11fe57 | tar -x -C .whl/x8tree; (its cache: gpu_cache.sh run in
# that tree, plus `musekern prepare --variant` of `bench/probes/x8_ahead.py labels`) -> .whl/x8tree/.musekern-cache
source bench/device_env.sh
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
if [[ $gpu == *H200* ]]; then
  # (no sanitizers: main's cubins are the ones h100-gpu-round.json ran them on, clean; device time is short)
  TEST_TIMEOUT=240 bash bench/gpu_round.sh > $OUT/round.txt 2>&1
  echo "round rc=$? t=$SECONDS"; tail -n 14 $OUT/round.txt
  rm -f $OUT/*.junit.xml  # folded into gpu-tests.json
  timeout $(( (${LIMIT:-575} - SECONDS) / 2 )) python3 bench/kv_fp8_bench.py --out $OUT/h200-kv-fp8-bench.json 2>$OUT/kv.log | tail -n 22
  echo "kv t=$SECONDS"
  timeout $((${LIMIT:-575} - SECONDS)) python3 bench/w8_bench.py --gemm-ms '' --out $OUT/h200-w8-bench.json 2>$OUT/w8.log \
    | tail -n 24
  echo "w8 t=$SECONDS"; grep -h "Traceback\|ok=False" $OUT/kv.log $OUT/w8.log | head -n 6
else
  cd .whl/x8tree && export PYTHONPATH="$PWD:/tmp/site" MUSEKERN_CACHE_DIR="$PWD/.musekern-cache"
  timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_x_quant.py 2>&1 | tail -n 2
  timeout 240 python3 bench/probes/x8_ahead.py run 2>$OUT/x8_ahead.log | tail -n 18
  echo "x8 t=$SECONDS"; grep -h "Traceback\|Error" $OUT/x8_ahead.log | head -n 4
fi
