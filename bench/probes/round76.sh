# Round 76: where round 75's fault comes from (w8_all_m, H100: "illegal memory access" after replaying TP1 M = 48's
# graphs): bench/probes/all_m_replay.py on this branch (history, each graph alone, padded workspace, memcheck), its
# `seq` on the tree before TP1's x-ahead build and x_quant's PDL launch (carried as .whl/maintree with its own cache:
# git archive 929cec4 | tar -x -C .whl/maintree, this probe copied in, gpu_cache.sh there), then w8_all_m again.
# Here: bash bench/gpu_cache.sh (+ main's tree).  GPU (carry .musekern-cache, .whl): bash bench/probes/round76.sh
source bench/device_env.sh
SECONDS=0
timeout 240 python3 bench/probes/all_m_replay.py run 1 40,41,48 2>&1 | tail -n 60
echo "probe t=$SECONDS"
(cd .whl/maintree && export PYTHONPATH="$PWD:/tmp/site" MUSEKERN_CACHE_DIR="$PWD/.musekern-cache" &&
 timeout 90 python3 bench/probes/all_m_replay.py seq 1 40,41,48 2>&1 | tail -n 24)
echo "main t=$SECONDS"
timeout $((420 - SECONDS)) python3 bench/w8_all_m.py --out $OUT/h100-w8-all-m.json 2>$OUT/all_m.log | tail -n 66
echo "all_m t=$SECONDS"; grep -h "Traceback\|Error" $OUT/all_m.log | head -n 4; tail -n 3 $OUT/all_m.log
