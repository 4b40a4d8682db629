# Round 75 (the call after round 74, same branch and cache): issue 30's all-M rows (bench/w8_all_m.py: the op with
# e4m3 weights at every M <= 4096 on TP8 / TP4 / TP1 beside bf16 weights, torch.mm and _scaled_mm, with its plot),
# then on an H200 kv_fp8_bench (issue 29's FP8-KV front and epilogue beside their bf16 twins). Outputs named by card.
# Here: bash bench/gpu_cache.sh.  GPU (carry .musekern-cache, .whl): LIMIT=<seconds> bash bench/probes/round75.sh
source bench/device_env.sh
SECONDS=0
L=${LIMIT:-575}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[0-9]00' | tr H h)
share=$([[ $gpu == h200 ]] && echo 2 || echo 1)  # on an H200 half the time is kv_fp8_bench's
timeout $(( (L - SECONDS) * (share == 2 ? 3 : 4) / 4 )) python3 bench/w8_all_m.py --out $OUT/$gpu-w8-all-m.json \
  2>$OUT/all_m.log | tail -n 66
echo "all_m rc=$? t=$SECONDS"; grep -h "Traceback\|Error" $OUT/all_m.log | head -n 4
if [[ $gpu == h200 ]]; then
  timeout $((L - SECONDS)) python3 bench/kv_fp8_bench.py --out $OUT/h200-kv-fp8-bench.json 2>$OUT/kv.log | tail -n 22
  echo "kv t=$SECONDS"; grep -h "Traceback\|Error" $OUT/kv.log | head -n 4
fi
