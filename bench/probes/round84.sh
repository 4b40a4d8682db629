# Round 84: the own cuBLASLt call's replay verdict (torch's 1x128 call alone, then the same three graphs through the
# own call: TP8 twice, TP1), the own call's and the GEMM path's GPU tests, w8_bench's GEMM path at M = 64 / 1024
# (through the own call), the H200 alternatives below, then w8_all_m at the M where torch's call faulted and around them
# (no BENCH_GRAPH_BLAS=clear) where 60 s of ROUND_S (560, the whole round) are left. Round 83 (the owed H200 round before it) ran at 9b36672, branch round83-h200.
# Run it from branch issue30-channel-lt: there ops.qkv_front.prepare takes the own call (and per-row scales the 1x128
# GEMM up to M = 72), so its GEMM-path tests, w8_bench and w8_all_m measure the product on it; on main they measure
# torch's call.
# The H200 misses of issue 30 (TP8 M = 1 0.79x bf16, TP1 78% of copy): bench/probes/w8_alts.py's deep8 (TP8's
# one-tile builds with the deepest ring), k1tp1 (TP1's W8A16 in place of W8A8 with x_quant ahead), split4 (TP8 at
# k_split 4), split2tp1 (TP1 at k_split 2), each beside the plan, in ALTS_S (280; 0 skips them: they are the H200's).
# Here: bash bench/gpu_cache.sh, then each ALT's labels: musekern prepare --target h200 --variant ... (w8_alts.py labels
# ALT).  GPU (carry .musekern-cache, .whl): bash bench/probes/round84.sh
source bench/device_env.sh
SECONDS=0
TOTAL=${ROUND_S:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
MS=33,36,40,44,48,52,56,60,64,72,96,100,128,256
last() { grep -E "^TP[0-9] M=[0-9]+$|rror|own cuBLASLt" "$1" | tail -n 2 | tr '\n' ' '; echo; }
timeout 60 python3 bench/probes/torch_block_mm_fault.py > /tmp/t0.txt 2>&1
echo "torch alone rc=$? t=$SECONDS: $(tail -n 1 /tmp/t0.txt)"; head -n 1 /tmp/t0.txt
for run in 1 2; do
  timeout 60 python3 bench/probes/gemm_forms.py --tps 8 --ms $MS --locate --only lt4,lt8,lt16 > /tmp/l$run.txt 2>&1
  echo "own TP8 run $run rc=$? t=$SECONDS: $(last /tmp/l$run.txt)"
done
timeout 90 python3 bench/probes/gemm_forms.py --tps 1 --ms $MS --locate --only lt4,lt8,lt16 > /tmp/l3.txt 2>&1
echo "own TP1 rc=$? t=$SECONDS: $(last /tmp/l3.txt)"
GPU_ROUND_NAME=$gpu-gemm-path-tests GPU_TESTS="tests/test_gpu_gemm.py tests/test_gpu_qkv_front.py" TEST_TIMEOUT=150 \
  bash bench/gpu_round.sh "own_block or block_scaled_mm_graphs or fp8_weight_gemm_path or fp8_weight_graph_replay" \
  2>&1 | tail -n 6
rm -f $OUT/*.junit.xml
echo "tests t=$SECONDS"
timeout 90 python3 bench/w8_bench.py --check-ms 1 --ms 999 --gemm-ms 64,1024 --out $OUT/$gpu-w8-gemm.json 2>/tmp/w8.log \
  | tail -n 12  # (M = 999: no front timing; the fronts' rows are h200-w8-bench.json's)
echo "w8 t=$SECONDS"; grep -h "ok=False" /tmp/w8.log | head -n 6; grep -A60 Traceback /tmp/w8.log | tail -n 2
S0=$SECONDS
for alt in $([ "${ALTS_S:-280}" -gt 0 ] && echo deep8 k1tp1 split4 split2tp1); do
  timeout $(( ${ALTS_S:-280} / 4 )) python3 bench/probes/w8_alts.py run $alt 2>/tmp/alt-$alt.log | tail -n 7
  echo "$alt rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror\|ok=False" /tmp/alt-$alt.log | head -n 4
done
echo "alts t=$((SECONDS - S0))"
if [ $((TOTAL - SECONDS)) -ge 60 ]; then
  timeout $((TOTAL - SECONDS)) python3 bench/w8_all_m.py --ms 33,40,48,56,64,72,96,128,256,1024 \
    --out $OUT/$gpu-w8-all-m.json 2>/tmp/all_m.log | tail -n 34
  echo "all_m rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror" /tmp/all_m.log | head -n 4; tail -n 2 /tmp/all_m.log
fi
