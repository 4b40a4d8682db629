# Round 87: where the 1x128 block-scaled GEMM's graph-replay fault reads or writes (round 86, H100: torch's call alone
# faults at M = 48 padded to 8, the own cuBLASLt call at TP8 M = 96 and TP1 M = 100, both the same cuBLASLt kernels):
# torch alone with only the pad-8 graph an M (round 86 ran pads 4 / 8 / 16 and faulted in pad 8's), then with 16 MiB
# of allocation past the end of every tensor, then past one kind at a time (a fault that vanishes names the buffer read
# past), then memcheck on both sequences; then round 85's W8A8 consumer comparison again where 200 s are left.
# Ran once (ROUND_S=0, H100): no fault in any, memcheck 0 errors (h100-e4m3-bounds.json block_mm_replay).
# GPU (carry .musekern-cache, .whl, .probe-lag64, .probe-lag8): bash bench/probes/round87.sh
source bench/device_env.sh
SECONDS=0
F=bench/probes/torch_block_mm_fault.py
MS=33,36,40,44,48,52,56,60,64,72,96,100,128,256
for on in none w,sw,q,sx,y sx sw q y w; do
  s=16777216; [ $on = none ] && s=0
  timeout 40 python3 $F --ms $MS --pads 8 --slack $s --on $on > $OUT/slack-$on.txt 2>&1
  echo "slack on $on rc=$? t=$SECONDS: $(tail -n 1 $OUT/slack-$on.txt)"
done
SAN="compute-sanitizer --tool memcheck --print-limit 8 --report-api-errors no"
timeout 150 $SAN python3 $F --ms $MS --pads 8 --loops 1 --replays 2 > $OUT/memcheck-torch.txt 2>&1
echo "memcheck torch rc=$? t=$SECONDS"; grep -m 12 -E "Invalid|Address|is out of bounds|nearest|ERROR SUMMARY|FAULT|ok$" \
  $OUT/memcheck-torch.txt | tail -n 12
timeout 120 $SAN python3 bench/probes/gemm_forms.py --tps 8 --ms 72,96 --locate --only lt4 --samples 1 \
  > $OUT/memcheck-own.txt 2>&1
echo "memcheck own rc=$? t=$SECONDS"; grep -m 8 -E "Invalid|Address|is out of bounds|nearest|ERROR SUMMARY|rror" \
  $OUT/memcheck-own.txt
if [ $((${ROUND_S:-560} - SECONDS)) -ge 200 ]; then RUN_S=85 bash bench/probes/round85.sh; fi
echo "done t=$SECONDS"
