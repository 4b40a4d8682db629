# Round 86: rounds 84 and 85 in one call, for a session whose device time allows one (failed starts ate the rest):
# the own cuBLASLt call's replay verdict (torch's 1x128 call alone, then the own call's graphs: TP8, TP1), then round
# 85's W8A8 consumer comparison (plan / lag64 / lag8 / plan2, M = 1 / 8, 5 samples), then the GEMM-path GPU tests
# where 100 s are left. Run from branch issue30-channel-lt (see round84.sh; the lag trees: round85.sh).
# GPU (carry .musekern-cache, .whl, .probe-lag64, .probe-lag8): bash bench/probes/round86.sh
source bench/device_env.sh
SECONDS=0
MS=33,36,40,44,48,52,56,60,64,72,96,100,128,256
last() { grep -E "^TP[0-9] M=[0-9]+$|rror|own cuBLASLt" "$1" | tail -n 2 | tr '\n' ' '; echo; }
timeout 40 python3 bench/probes/torch_block_mm_fault.py > /tmp/t0.txt 2>&1
echo "torch alone rc=$? t=$SECONDS: $(tail -n 1 /tmp/t0.txt)"; head -n 1 /tmp/t0.txt
timeout 50 python3 bench/probes/gemm_forms.py --tps 8 --ms $MS --locate --only lt4,lt8,lt16 > /tmp/l1.txt 2>&1
echo "own TP8 rc=$? t=$SECONDS: $(last /tmp/l1.txt)"
timeout 70 python3 bench/probes/gemm_forms.py --tps 1 --ms $MS --locate --only lt4,lt8,lt16 > /tmp/l3.txt 2>&1
echo "own TP1 rc=$? t=$SECONDS: $(last /tmp/l3.txt)"
cp /tmp/l1.txt $OUT/own-tp8.txt; cp /tmp/l3.txt $OUT/own-tp1.txt; cp /tmp/t0.txt $OUT/torch-alone.txt
RUN_S=${RUN_S:-85} SAMPLES=5 bash bench/probes/round85.sh
echo "lag t=$SECONDS"
if [ $((560 - SECONDS)) -ge 100 ]; then
  GPU_ROUND_NAME=gemm-path-tests GPU_TESTS="tests/test_gpu_gemm.py tests/test_gpu_qkv_front.py" \
    TEST_TIMEOUT=$((560 - SECONDS)) bash bench/gpu_round.sh \
    "own_block or block_scaled_mm_graphs or fp8_weight_gemm_path or fp8_weight_graph_replay" 2>&1 | tail -n 6
  rm -f $OUT/*.junit.xml
fi
echo "done t=$SECONDS"
