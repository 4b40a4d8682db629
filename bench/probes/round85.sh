# Round 85 (issue 30, the H200 misses): the W8A8 consumer with one wgmma group in flight (branch issue30-wg8-lag:
# WG8_RUN k-tiles a run, 64 = the whole loop unrolled, 8 = runs of 8) against the plan's consumer, each
# through w8_bench (checks at M = 1 / 8, timing M = 1 / 8 at every shard: TP4 / TP2 are W8A16, unchanged, the
# control), plan first and last (drift between processes).
# Here: bash bench/gpu_cache.sh; for r in 64 8: mkdir -p .probe-lag$r && git archive issue30-wg8-lag musekern | tar -x
#   -C .probe-lag$r && sed -i "s/^WG8_RUN = .*/WG8_RUN = $r/" .probe-lag$r/musekern/kernels/qkv_front/mma.py, then
#   (outside the repository) PYTHONPATH=$REPO/.probe-lag$r:$REPO musekern prepare --target h200 --cache-dir
#   $REPO/.musekern-cache --variant ... (bench/w8_labels.py).
# GPU (carry .musekern-cache, .whl, .probe-lag64, .probe-lag8): bash bench/probes/round85.sh
source bench/device_env.sh
SECONDS=0
base=$PYTHONPATH
for tree in plan lag64 lag8 plan2; do
  p=$base; case $tree in lag*) p=$PWD/.probe-$tree:$base;; esac
  PYTHONPATH=$p timeout ${RUN_S:-130} python3 bench/w8_bench.py --check-ms 1,8 --ms 1,8 --gemm-ms "" --samples ${SAMPLES:-7} \
    --out $OUT/w8-$tree.json 2>/tmp/w8-$tree.log >/tmp/w8-$tree.txt
  echo "$tree rc=$? t=$SECONDS $(grep -c 'ok=True' /tmp/w8-$tree.log) checks ok, $(grep -c 'ok=False' /tmp/w8-$tree.log) not"
  grep -h "Traceback\|rror" /tmp/w8-$tree.log | head -n 3
done
python3 - <<'PY'
import json, os
rows = {}
for tree in ("plan", "lag64", "lag8", "plan2"):
    try:
        d = json.load(open(os.path.join(os.environ["OUT"], f"w8-{tree}.json")))
    except (OSError, ValueError):
        continue
    for r in d["timing"]:
        rows.setdefault((r["tp"], r["M"]), {})[tree] = r
print("TP M | tree: e4m3 channel / block chain us (ratio to bf16) | after a norm ratio ch / blk")
for (tp, m), by in sorted(rows.items()):
    for tree, r in by.items():
        u, q = r["us"], r["ratio"]
        print(f"TP{tp} M={m} {tree:6s} | {u['chain_fp8_channel']:.2f} / {u['chain_fp8_block']:.2f} "
              f"({q['chain_channel']:.3f} / {q['chain_block']:.3f}) bf16 {u['chain_bf16']:.2f} | "
              f"{q['after_norm_channel']:.3f} / {q['after_norm_block']:.3f}")
PY
