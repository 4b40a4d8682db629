# Round 89 (the H200's second call, after round90.sh): the all-M rows on the H200 (w8_all_m, --ms below: the front's
# edges, the GEMM path, where the H100's 1x128 call faulted), then the 1x128 fault's history on the H200 (torch's
# call alone as round 86 ran it, each M's graphs torn down and torch.cuda.empty_cache() before the next; with
# --keep-cache: a graph reading memory an earlier M's teardown gave back would stop faulting), in ROUND_S (570).
# Here: bash bench/gpu_cache.sh. GPU (carry .musekern-cache, .whl): bash bench/probes/round89.sh
source bench/device_env.sh
SECONDS=0
TOTAL=${ROUND_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
timeout $((TOTAL - 100)) python3 bench/w8_all_m.py --ms 1,8,16,17,32,33,64,128,256,1024,4096 \
  --out $OUT/$gpu-w8-all-m.json 2>/tmp/all_m.log | tail -n 40
echo "all_m rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror" /tmp/all_m.log | head -n 4; tail -n 2 /tmp/all_m.log
F=bench/probes/torch_block_mm_fault.py
for run in default keep; do
  left=$(( (TOTAL - SECONDS) / 2 )); [ $run = keep ] && left=$((TOTAL - SECONDS)); [ $left -lt 10 ] && break
  timeout $left python3 $F $([ $run = keep ] && echo --keep-cache) > $OUT/fault-$run.txt 2>&1
  echo "fault $run rc=$? t=$SECONDS: $(tail -n 1 $OUT/fault-$run.txt)"
done
