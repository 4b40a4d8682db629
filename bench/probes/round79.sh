# Round 79: where the GEMM path's "illegal memory access" comes from. Round 78 (H100): w8_all_m faulted at TP1 M = 48
# again (after TP8 / TP4 and TP1 M <= 41), all_m_replay's seq of TP1 M = 40, 41, 48 ran clean (memcheck too), and
# gemm_forms faulted within 13 s. memcheck inside torch's caching allocator sees its segments, not the tensors: a read
# a little past a tensor passes unless the segment ends there. So: gemm_forms plain (which M, which graph), then
# memcheck with every tensor its own allocation: eager with the caching allocator off (the op's GEMM path, every
# form, all shards) and graphs on cudaMallocAsync (gemm_forms TP8, all_m_replay TP1 M = 48), and sanitize_qkv_front
# with the caching allocator off.
# Here: bash bench/gpu_cache.sh.  GPU (carry .musekern-cache, .whl): bash bench/probes/round79.sh
source bench/device_env.sh
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
timeout 120 python3 bench/probes/gemm_forms.py --out $OUT/$gpu-gemm-forms.json > /tmp/gf.txt 2>&1
echo "forms rc=$? t=$SECONDS"; grep -v "^  " /tmp/gf.txt | tail -n 8; tail -n 22 /tmp/gf.txt
san="compute-sanitizer --tool memcheck --print-limit 6 --report-api-errors no"
summ() { grep -E "^========= (Invalid|ERROR SUMMARY)|^=========     at |by thread|Address" "$1" | head -n 24; }
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 $san python3 bench/probes/gemm_forms.py --eager --ms 33,48,64,100,1024 \
  > /tmp/m1.txt 2>&1 &
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 $san python3 bench/sanitize_qkv_front.py > /tmp/m2.txt 2>&1 &
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync timeout 300 $san python3 bench/probes/gemm_forms.py --tps 8 \
  --ms 33,48 --loops 1 --samples 1 > /tmp/m3.txt 2>&1 &
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync LOOPS=1 timeout 300 $san python3 bench/probes/all_m_replay.py seq 1 48 \
  > /tmp/m4.txt 2>&1 &
wait
for i in 1 2 3 4; do echo "== m$i t=$SECONDS"; summ /tmp/m$i.txt; grep -v "^=========" /tmp/m$i.txt | tail -n 3; done
cp /tmp/m?.txt /tmp/gf.txt $OUT/ 2>/dev/null
