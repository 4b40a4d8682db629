# Round 70: branch issue30-x8-ahead: x_quant with PDL ahead of the front (xq_chain), the W8A8 front reading x
# quantized ahead (x8_ahead: check + time)
source bench/device_env.sh
SECONDS=0
timeout 120 python3 bench/probes/xq_chain.py 2>$OUT/xq_chain.json | tail -n 6; echo "t=$SECONDS"
timeout 200 python3 bench/probes/x8_ahead.py run 2>$OUT/x8_ahead.log | tail -n 18; echo "t=$SECONDS"
grep -i "error\|Traceback" $OUT/x8_ahead.log | head -n 5
