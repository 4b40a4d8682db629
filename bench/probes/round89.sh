# Round 89 (the H200's second call, after round90.sh): the all-M rows on the H200 (w8_all_m, --ms below: the front's
# edges, the GEMM path, where the H100's 1x128 call faulted), then the 1x128 fault's history on the H200
# (probes/fault_history.sh), in ROUND_S (570).
# Here: bash bench/gpu_cache.sh. GPU (carry .musekern-cache, .whl): bash bench/probes/round89.sh
source bench/device_env.sh
SECONDS=0
TOTAL=${ROUND_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
timeout $((TOTAL - 200)) python3 bench/w8_all_m.py --ms 1,8,16,17,32,33,64,128,256,1024,4096 \
  --out $OUT/$gpu-w8-all-m.json 2>/tmp/all_m.log | tail -n 40
echo "all_m rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror" /tmp/all_m.log | head -n 4; tail -n 2 /tmp/all_m.log
source bench/probes/fault_history.sh
