# Round 89 (after round 88, same cache): issue 30's H200 misses, each suspect beside the plan in one process
# (bench/probes/w8_alts.py: deep8 = TP8's one-tile builds with the deepest ring one CTA an SM holds; split4 = TP8 at
# k_split 4, 136 CTAs; k1tp1 = TP1's one-tile builds W8A16 in place of W8A8 + x_quant ahead; split2tp1 = TP1 at
# k_split 2, no third wave of 8 CTAs), then the all-M rows on the H200 (w8_all_m, --ms below: the front's edges, the
# GEMM path, where the H100's 1x128 call faulted) in what is left of ROUND_S (570). W8_BENCH=1: round 88's w8_bench
# first (where round 88 ran on another GPU).
# Here: bash bench/gpu_cache.sh, then each ALT's labels: musekern prepare --target h200 --variant ... (w8_alts.py
# labels ALT).  GPU (carry .musekern-cache, .whl): bash bench/probes/round89.sh
source bench/device_env.sh
SECONDS=0
TOTAL=${ROUND_S:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
if [ "${W8_BENCH:-0}" = 1 ]; then
  timeout 90 python3 bench/w8_bench.py --check-ms 1,2,7,8,9,16 --ms 1,8,16 --gemm-ms 64,1024 \
    --out $OUT/$gpu-w8-bench.json 2>/tmp/w8.log | tail -n 24
  echo "w8 t=$SECONDS"; grep -h "ok=False" /tmp/w8.log | head -n 6; grep -A60 Traceback /tmp/w8.log | tail -n 2
fi
for alt in deep8 split4 k1tp1 split2tp1; do
  timeout 75 python3 bench/probes/w8_alts.py run $alt 2>/tmp/alt-$alt.log | tail -n 7
  echo "$alt rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror\|ok=False" /tmp/alt-$alt.log | head -n 4
done
if [ $((TOTAL - SECONDS)) -ge 60 ]; then
  timeout $((TOTAL - SECONDS)) python3 bench/w8_all_m.py --ms 1,8,16,17,32,33,64,128,256,1024,4096 \
    --out $OUT/$gpu-w8-all-m.json 2>/tmp/all_m.log | tail -n 40
  echo "all_m rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror" /tmp/all_m.log | head -n 4; tail -n 2 /tmp/all_m.log
fi
