# Round 78, card-aware. Both cards: bench/probes/gemm_forms.py (which FP8 GEMM form the GEMM path should take:
# row-wise against 1x128 blocks with M padded to 4 / 8 / 16, the product path beside) after the owed work. On an H200,
# the round owed there for issues 29 / 30: the whole GPU round with the sanitizers, w8_bench (GEMM path at M = 64 /
# 1024), kv_fp8_bench, w8_all_m, then round 75's fault probe. On an H100: round 76 (the fault probe, main's tree,
# w8_all_m), then gemm_forms.
# Here: bash bench/gpu_cache.sh (+ main's tree, round76.sh).  GPU (carry .musekern-cache, .whl): bash bench/probes/round78.sh
source bench/device_env.sh
SECONDS=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
if [[ $gpu != h200 ]]; then
  bash bench/probes/round76.sh
  timeout $((560 - SECONDS)) python3 bench/probes/gemm_forms.py --out $OUT/$gpu-gemm-forms.json 2>/tmp/gf.log
  echo "forms rc=$? t=$SECONDS"; grep -h "Traceback\|Error" /tmp/gf.log | head -n 4
  exit 0
fi
source bench/probes/h200_owed.sh
timeout 80 python3 bench/w8_all_m.py --out $OUT/h200-w8-all-m.json 2>$OUT/all_m.log | tail -n 66
echo "all_m t=$SECONDS"; grep -h "Traceback\|Error" $OUT/all_m.log | head -n 4; tail -n 2 $OUT/all_m.log
timeout $((520 - SECONDS)) python3 bench/probes/gemm_forms.py --out $OUT/h200-gemm-forms.json 2>/tmp/gf.log
echo "forms rc=$? t=$SECONDS"; grep -h "Traceback\|Error" /tmp/gf.log | head -n 4
timeout $((580 - SECONDS)) python3 bench/probes/all_m_replay.py run 1 40,41,48 2>&1 | tail -n 30
echo "probe t=$SECONDS"
