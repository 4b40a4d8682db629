# Round 88 (main with the W8A8 consumer's runs of 8, WG8_RUN): the whole GPU round with the sanitizers on main's cache
# (the new consumer's first GPU tests: round 86 ran only w8_bench's checks on it), w8_bench on every shard (on an H200
# its file replaces bench/results/h200-w8-bench.json: issue 30's misses with the new consumer), then the 1x128 fault's
# history (round 87 found no fault with one graph an M): torch's call alone as round 86 ran it (pads 4 / 8 / 16, each
# M's graphs torn down and torch.cuda.empty_cache() before the next), twice; with --keep-cache (no empty_cache: a graph
# reading memory an earlier M's teardown gave back would stop faulting); under memcheck (the faulting kernel, named).
# Here: bash bench/gpu_cache.sh. GPU (carry .musekern-cache, .whl): bash bench/probes/round88.sh
source bench/device_env.sh
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
SANITIZE=1 SAN_TIMEOUT=200 TEST_TIMEOUT=240 bash bench/gpu_round.sh > $OUT/round.txt 2>&1
echo "round rc=$? t=$SECONDS"; tail -n 14 $OUT/round.txt
rm -f $OUT/sanitizer-*.log $OUT/*.junit.xml  # folded into gpu-tests.json
timeout 90 python3 bench/w8_bench.py --check-ms 1,2,7,8,9,16 --ms 1,8,16 --gemm-ms 64,1024 --out $OUT/$gpu-w8-bench.json \
  2>/tmp/w8.log | tail -n 24
echo "w8 t=$SECONDS"; grep -h "ok=False" /tmp/w8.log | head -n 6; grep -A60 Traceback /tmp/w8.log | tail -n 2
F=bench/probes/torch_block_mm_fault.py
for run in default default2 keep; do
  timeout 45 python3 $F $([ $run = keep ] && echo --keep-cache) > $OUT/fault-$run.txt 2>&1
  echo "fault $run rc=$? t=$SECONDS: $(tail -n 1 $OUT/fault-$run.txt)"
done
timeout $((580 - SECONDS)) compute-sanitizer --tool memcheck --print-limit 8 --report-api-errors no python3 $F \
  --loops 2 --replays 2 > $OUT/fault-memcheck.txt 2>&1
echo "memcheck rc=$? t=$SECONDS"; grep -m 10 -E "Invalid|Address|out of bounds|nearest|in [a-z_0-9]+|ERROR SUMMARY|FAULT" \
  $OUT/fault-memcheck.txt
