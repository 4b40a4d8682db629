# The 1x128 fault's history (sourced by round89.sh / round90.sh after bench/device_env.sh, with $OUT, SECONDS and TOTAL
# set): torch's call alone as round 86 ran it (it faulted there at M = 48 padded to 8); the same with 16 MiB allocated
# past every tensor (a fault that stops: a read past a tensor's end); --keep-cache (no torch.cuda.empty_cache() after
# each M); each call once with no graph, every tensor its own cudaMalloc, under memcheck (a read past any tensor shows).
F=bench/probes/torch_block_mm_fault.py
for run in default slack keep; do
  left=$(( (TOTAL - SECONDS - 60) / 2 )); [ $left -gt 45 ] && left=45; [ $left -lt 10 ] && break
  args=(); [ $run = slack ] && args=(--slack 16777216); [ $run = keep ] && args=(--keep-cache)
  timeout $left python3 $F "${args[@]}" > $OUT/fault-$run.txt 2>&1
  echo "fault $run rc=$? t=$SECONDS: $(tail -n 1 $OUT/fault-$run.txt)"
done
if [ $((TOTAL - SECONDS)) -ge 20 ]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $((TOTAL - SECONDS)) compute-sanitizer --tool memcheck --print-limit 8 \
    --report-api-errors no python3 $F --eager > $OUT/fault-memcheck.txt 2>&1
  echo "memcheck eager rc=$? t=$SECONDS: $(grep -m 1 'ERROR SUMMARY' $OUT/fault-memcheck.txt)"
  grep -m 8 -E "Invalid|out of bounds|bytes after|is at|in [a-zA-Z_0-9]+$" $OUT/fault-memcheck.txt
fi
