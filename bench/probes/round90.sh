# Round 90 (round 88 folded in; round89.sh is the H200's second call): one call that serves whichever GPU comes
# (the pool gave 2 calls in ~15 tries in round 86-88's sessions).
# The whole GPU round with the sanitizers (the W8A8 consumer's runs of 8 k-tiles, WG8_RUN, have had no GPU test
# yet), w8_bench on every shard (-> $OUT/<gpu>-w8-bench.json), then on an H200 issue 30's suspects beside the plan
# (w8_alts: deep8, wg4, split2tp1, k1tp1, split4), on an H100 the 1x128 fault's history
# (probes/fault_history.sh), in what is left of ROUND_S (575).
# Here (build extra installed): bash bench/probes/round90.sh cache  (bench/gpu_cache.sh + the suspects' builds).
# GPU (carry .musekern-cache, .whl): bash bench/probes/round90.sh
ALTS=(deep8 wg4 split2tp1 k1tp1 split4)
if [ "${1:-}" = cache ]; then
  bash bench/gpu_cache.sh || exit 1
  for alt in "${ALTS[@]}"; do
    musekern prepare --target h200 --cache-dir .musekern-cache -j 2 \
      $(for l in $(python3 bench/probes/w8_alts.py labels $alt); do echo --variant $l; done) >&2 || exit 1
  done
  exit 0
fi
source bench/device_env.sh
SECONDS=0
TOTAL=${ROUND_S:-575}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
SANITIZE=1 SAN_TIMEOUT=190 TEST_TIMEOUT=230 bash bench/gpu_round.sh > $OUT/round.txt 2>&1
echo "round rc=$? t=$SECONDS"; tail -n 14 $OUT/round.txt
rm -f $OUT/sanitizer-*.log $OUT/*.junit.xml  # folded into gpu-tests.json
timeout 80 python3 bench/w8_bench.py --check-ms 1,2,7,8,9,16 --ms 1,8,16 --gemm-ms 64,1024 --out $OUT/$gpu-w8-bench.json \
  2>/tmp/w8.log | tail -n 24
echo "w8 t=$SECONDS"; grep -h "ok=False" /tmp/w8.log | head -n 6; grep -A60 Traceback /tmp/w8.log | tail -n 2
if [ $gpu = h200 ]; then
  for i in "${!ALTS[@]}"; do
    left=$(( (TOTAL - SECONDS) / (${#ALTS[@]} - i) )); [ $left -lt 20 ] && break
    timeout $left python3 bench/probes/w8_alts.py run ${ALTS[$i]} 2>/tmp/alt.log | tail -n 7
    echo "${ALTS[$i]} rc=${PIPESTATUS[0]} t=$SECONDS"; grep -h "Traceback\|rror\|ok=False" /tmp/alt.log | head -n 4
  done
else
  source bench/probes/fault_history.sh
fi
