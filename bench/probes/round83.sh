# Round 83: the block path's 1x128 GEMM through musekern's own cuBLASLt call (gemm.fp8.prepare_blocks: the algorithm
# torch's call takes, a workspace from the graph's pool each call) against torch's call, which faults in graph replay
# (round 82). torch alone first (bench/probes/torch_block_mm_fault.py: the upstream repro), then the same three graphs
# through the own call (TP8 twice, TP1); on an H200 the owed round (h200_owed.sh: every GPU test, the own call's
# included, with the sanitizers; w8_bench; kv_fp8_bench), elsewhere the GEMM path's tests; then the product's all-M
# run with no BENCH_GRAPH_BLAS=clear (it faulted at TP1 M = 48 in 3 of 3 runs so) in the time left (ROUND_S, 590).
# Here: bash bench/gpu_cache.sh.  GPU (carry .musekern-cache, .whl): bash bench/probes/round83.sh
source bench/device_env.sh
SECONDS=0
TOTAL=${ROUND_S:-590}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
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
if [[ $gpu == h200 ]]; then
  source bench/probes/h200_owed.sh
else
  GPU_ROUND_NAME=$gpu-gemm-path-tests GPU_TESTS="tests/test_gpu_gemm.py tests/test_gpu_qkv_front.py" TEST_TIMEOUT=200 \
    bash bench/gpu_round.sh "own_block or block_scaled_mm_graphs or fp8_weight_gemm_path or fp8_weight_graph_replay" \
    2>&1 | tail -n 8
  echo "tests t=$SECONDS"
fi
timeout $((TOTAL - SECONDS)) python3 bench/w8_all_m.py --out $OUT/$gpu-w8-all-m.json 2>/tmp/all_m.log | tail -n 64
echo "all_m rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror" /tmp/all_m.log | head -n 4; tail -n 2 /tmp/all_m.log
