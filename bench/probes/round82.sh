# Round 82: which graph of gemm_forms faults, alone. Round 81 (H100): the fault is not empty_cache's (it came at TP8
# M = 96 with and without it; cuBLAS workspaces cleared around each capture moved it to M = 128), gemm_forms named the
# probe's own 1x128 block GEMM graph (block4: x pre-quantized, its tensors outside the graph pool), and w8_all_m ran
# every M of every shard clean with the workspaces cleared. Here, each in its own process, TP8 M = 33..256 with every
# graph replayed alone once captured: only block4; only the row-wise GEMM; only the product's block path; only its
# channel path (1x128 up to CHANNEL_BLOCK_MAX_ROWS); then block4 under memcheck (the kernel and the address).
# Here: bash bench/gpu_cache.sh.  GPU (carry .musekern-cache, .whl): bash bench/probes/round82.sh
source bench/device_env.sh
SECONDS=0
MS=33,36,40,44,48,52,56,60,64,72,96,100,128,256
last() { grep -E "^TP[0-9] M=[0-9]+$|error|^  replay" "$1" | tail -n 3 | tr '\n' ' '; echo; }
for only in block4 rowwise fp8_block fp8_channel block16; do
  timeout 60 python3 bench/probes/gemm_forms.py --tps 8 --ms $MS --locate --only $only > /tmp/o.txt 2>&1
  echo "$only rc=$? t=$SECONDS: $(last /tmp/o.txt)"
done
BENCH_GRAPH_BLAS=clear timeout 60 python3 bench/probes/gemm_forms.py --tps 8 --ms $MS --locate --only block4 > /tmp/o.txt 2>&1
echo "block4 cleared rc=$? t=$SECONDS: $(last /tmp/o.txt)"
timeout 60 python3 bench/probes/gemm_forms.py --tps 1 --ms 72,80,88,96,100,128 --only fp8_channel,rowwise,block4 \
  2>/dev/null | tail -n 7
echo "tp1 t=$SECONDS"
timeout $((560 - SECONDS)) compute-sanitizer --tool memcheck --print-limit 4 --report-api-errors no \
  python3 bench/probes/gemm_forms.py --tps 8 --ms $MS --locate --only block4 --loops 1 --samples 1 > /tmp/m.txt 2>&1
echo "memcheck rc=$? t=$SECONDS"; grep -E "^========= " /tmp/m.txt | head -n 30; last /tmp/m.txt
