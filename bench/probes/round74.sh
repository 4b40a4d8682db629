# Round 74 (branch issue30-x8-tp1: TP1's e4m3 one-tile build reads x quantized ahead): the whole GPU round with the
# sanitizers (the W8A8 builds' launches through the op, TP1's x-ahead ones among them), then w8_bench (its checks run
# each planned build against its arithmetic; its fronts beside the bf16 one and _scaled_mm; the GEMM path at the
# README's M = 64 / 1024: x_quant changed).
# Here: bash bench/gpu_cache.sh.  GPU (carry .musekern-cache, .whl): bash bench/probes/round74.sh
source bench/device_env.sh
SECONDS=0
SANITIZE=1 SAN_TIMEOUT=240 TEST_TIMEOUT=300 bash bench/gpu_round.sh > $OUT/round.txt 2>&1
echo "round rc=$? t=$SECONDS"; tail -n 14 $OUT/round.txt
rm -f $OUT/sanitizer-*.log $OUT/*.junit.xml  # folded into gpu-tests.json
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
timeout $((570 - SECONDS)) python3 bench/w8_bench.py --gemm-ms 64,1024 --out $OUT/$gpu-w8-bench.json 2>$OUT/w8.log | tail -n 24
echo "w8 t=$SECONDS"; grep -h "Traceback\|ok=False" $OUT/w8.log | head -n 6
