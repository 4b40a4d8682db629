# Round 73: main's GPU tests on whichever card comes (the kernels' cubins are 8cac4dd's, bench/same_cubins.py); on an
# H200 also the round owed for issues 29 / 30: kv_fp8_bench and w8_bench (checks and fronts; no GEMM-path timing);
# then the x-ahead W8A8 build at TP1 (branch issue30-x8-ahead 6e1ec4e, carried as .whl/x8tree with its own cache:
# git archive 6e1ec4e | tar -x -C .whl/x8tree; there gpu_cache.sh + prepare --variant $(X8_TP=1 x8_ahead.py labels)).
# Here: bash bench/gpu_cache.sh.  GPU (carry .musekern-cache, .whl): LIMIT=<seconds> [H200_ONLY=1] bash bench/probes/round73.sh
source bench/device_env.sh
SECONDS=0
L=${LIMIT:-575}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
if [[ $gpu != *H200* && ${H200_ONLY:-0} = 1 ]]; then echo "$gpu: not an H200, nothing run (H200_ONLY=1)"; exit 0; fi
x8_tp1() {
  (cd .whl/x8tree && export PYTHONPATH="$PWD:/tmp/site" MUSEKERN_CACHE_DIR="$PWD/.musekern-cache" X8_TP=1 &&
   timeout $((L - SECONDS)) python3 bench/probes/x8_ahead.py run 2>$OUT/x8_tp1.log | tail -n 12)
  echo "x8 tp1 t=$SECONDS"; grep -h "Traceback\|Error" $OUT/x8_tp1.log | head -n 4
}
[[ $gpu == *H200* ]] || x8_tp1
TEST_TIMEOUT=$((L - SECONDS < 240 ? L - SECONDS : 240)) bash bench/gpu_round.sh > $OUT/round.txt 2>&1
echo "round rc=$? t=$SECONDS"; tail -n 14 $OUT/round.txt
rm -f $OUT/*.junit.xml  # folded into gpu-tests.json
if [[ $gpu == *H200* ]]; then
  timeout $(( (L - SECONDS) / 3 )) python3 bench/kv_fp8_bench.py --out $OUT/h200-kv-fp8-bench.json 2>$OUT/kv.log \
    | tail -n 22
  echo "kv t=$SECONDS"
  timeout $(( (L - SECONDS) / 2 )) python3 bench/w8_bench.py --gemm-ms '' --out $OUT/h200-w8-bench.json 2>$OUT/w8.log \
    | tail -n 24
  echo "w8 t=$SECONDS"; grep -h "Traceback\|ok=False" $OUT/kv.log $OUT/w8.log | head -n 6
  x8_tp1
fi
