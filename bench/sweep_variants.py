#!/usr/bin/env python3
"""Time qkv_front builds that differ from the plan (ring depth, k_split) side by side, on the GPU.

Usage (GPU machine, cache carried): python3 bench/sweep_variants.py OUT.json [LABEL ...]   (default: GRID)
  or  python3 bench/sweep_variants.py OUT.json --n 8704 --kv 4 --stages 3,4,5,8 --splits 1 --m 1,16

Per variant and M: a CUDA graph of 8 launches over 8 distinct weights (streams from HBM, not L2),
with PDL (chain) and without (isolated), timed like `musekern bench` (musekern/bench/timing.py: median of
7 samples; rounds 1-13 of bench/NOTES.md used this script's own replay loop, same graphs); us per launch and
the fraction of copy bandwidth (weight bytes / time / copy bandwidth measured in the same run). Also the
occupancy the driver reports (blocks per SM, active clusters), which the planner's rules use.
"""
import argparse
import itertools
import json
import statistics
import sys

import torch
from cuda.bindings import driver as drv

from musekern.bench.report import commit_info
from musekern.bench.timing import Graph, copy_bandwidth, time_graphs
from musekern.ops.qkv_front import launch_args
from musekern.runtime import get_kernel
from musekern.variants import QkvFrontVariant, variant_from_label
from musekern.variants.qkv_front import HIDDEN, fixed_rows, launch_grid, token_tiles

LAYERS, REPS, LOOPS = 8, 7, 8
DISTINCT_OUT = False  # --distinct-out: one y buffer per layer (as musekern bench does) instead of a shared one
# The default sweep. Rounds 1-7 (bench/NOTES.md) swept ring depth x k_split x PDL trigger, the L2 prefetch,
# the k-tile rotation and a 5-stage ring; round 8 the consumer warps' split of a k-tile (warp_split) at every
# planned N (h200-sweep-warp-split.json); round 9 the TP8 split A/B with repeats, k_split 4 and the early
# trigger at TP8 (h200-sweep-round9.json); round 10 TP1's deep ring at 8-10 stages (h200-sweep-round10.json).
# Round 11 (--repeat 2): no explicit PDL trigger ("exit") against "late" where the chain is slower than the
# isolated launches (TP4) and at TP2 / TP8; TP1's one-tile deep ring at 11 stages against 10
# (h200-sweep-round11.json). Round 12: the skeleton probe (h200-skeleton-probe.json) bounds the chain at
# 79% (TP8) / 94% (TP4) of copy bandwidth while only the ring streams before the wait; can the L2 take the
# rest? The whole W slice prefetched into L2 before the wait (l2_prefetch 64), with the next grid let in
# once the wait returned ("wait": at most two layers' weights in flight), against the plan.
# Round 13 (--repeat 3): L2 prefetch and "wait" were slower everywhere (h200-sweep-round12.json). With TP4's
# dependents now launched at exit, its chain follows its isolated launches, where "k" was faster (round 9):
# TP4 "rows" vs "k" under "exit", both tile counts; TP2's two-tile build with "k" under "late" and "exit".
# Round 16 (--repeat 2): the skeleton probe (h200-skeleton-probe-ahead-r*.json) streams TP8's chain at 92-96% of
# copy bandwidth when "late" triggers one ring turn before the last load (trigger_ahead) and the consumers stash
# k-tiles of W in registers before x exists; the front with both, at TP8 (one tile: "rows" with stash; two
# tiles: "k", trigger_ahead only) and at TP2's "late" builds (h200-sweep-round16.json).
# Round 17 (--repeat 3): the trace probe (h200-tail-trace.json) says TP8 streams at ~3 TB/s between x and its last
# k-tile: 5 stages do not keep enough bytes in flight. With the smem outside the ring sized by owned tokens a
# 6-stage one-tile ring still fits two CTAs per SM: 5 vs 6 stages x trigger_ahead 4-6 at TP8, and the two-tile
# build (5 stages, smaller smem now) for reference.
# Round 18 (--repeat 2): the trace probe shows TP4's "exit" overlapping nothing (the next grid starts 1.5 us after
# the last epilogue, every layer); the next grid cannot land early because 2 x 136 CTAs exceed 2 x 132 slots.
# A 3-stage ring fits three CTAs per SM (59 KiB; "k" with one tile: 106 registers): TP4 and TP2 with 3 stages
# under "exit" and under "late" with trigger_ahead, both tile counts ("rows" where "k"'s registers allow two
# per SM only).
# Round 19 (--repeat 2): the trace (round 17) puts TP8's streaming phase at ~3.8 TB/s, bound by the bytes in
# flight (68 CTAs x 6 stages); a deep ring (one CTA per SM, up to 11 stages) doubles them, and under "late" with
# trigger_ahead the next grid has 64 free SMs to land on (only 2 of its 34 clusters wait). Round 9's deep ring
# at TP8 was measured with the early trigger (grids stacking up), never with trigger_ahead.
# Round 20 (--repeat 2): TP8 isolated (plain stream order, what engines without PDL see) is at 66-70% of copy
# bandwidth: k_split 4 (136 CTAs, 256 KiB of W each: more CTAs streaming, twice the bytes in flight at two per
# SM) was last measured at round 9 with the early trigger; against the plan, under "late" + trigger_ahead and
# "exit".
# Round 23 (--repeat 2): the trace (h200-tail-trace-r22.json) says the deep ring's chain wants the next grid's
# prefill to fill this grid's drain, the after-norm mode a trigger ~1.3 us earlier (h200-tail-trace-r21*.json): a
# stash (up to 4 k-tiles of W in the consumers' registers before x exists; one CTA per SM leaves the register file
# free) makes an early-landing grid's prefill longer. 11 stages x stash 0 / 2 / 4 x trigger_ahead 6 / 8 / 11 / 14.
# Round 25 (--repeat 2): round 23 found the stash slows the deep ring; the deep ring itself is what streams TP8's
# chain at 91%: 68 CTAs alone on their SMs, the next grid landing on the 64 left free, the trigger 6 k-tiles ahead.
# TP4 has the same CTA count at k_split 1 (68 heads, one CTA each, 1 MiB of W), never measured with a deep ring
# and trigger_ahead (round 16's skeleton tried S = 1 with 5 stages only): 11 stages (10 with two tiles) x
# trigger_ahead x warp split, against the plan (S = 2, 4 stages, "exit", "k").
# Round 26 (--repeat 2): the trace says a prefill still landing when the previous grid ends delays what waits on
# that grid (h200-tail-trace-r21*.json); a variant field `defer` (removed again: db5d230 has it) loaded the ring's
# last stages after griddepcontrol.wait: TP8's deep ring x trigger_ahead 6 / 8 x defer 0 / 4 / 6
# (h200-sweep-round26.json: slower in every mode).
# The grid below is round 25's (the last one this tree can build).
# Each entry: the variant's fields except tiles and fixed_m (from M), and the Ms to time.
TP4 = dict(n=4352, num_kv_heads=2, k_rotate=1)
GRID = [(dict(TP4, splits=2, stages=4, trigger="exit", warp_split="k"), (1, 16))] \
    + [(dict(TP4, splits=1, stages=11, trigger="late", trigger_ahead=a, warp_split=ws), (1,))
       for ws, a in (("rows", 6), ("rows", 8), ("rows", 11), ("rows", 16), ("k", 8))] \
    + [(dict(TP4, splits=1, stages=10, trigger="late", trigger_ahead=a, warp_split="k"), (16,)) for a in (8, 11)]


def grid_jobs():
    return [(QkvFrontVariant(tiles=token_tiles(m), fixed_m=fixed_rows(m), **fields), m)
            for fields, ms in GRID for m in ms]


def occupancy(k) -> dict:
    L = k.abi.launch
    blocks = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.func, L.block[0], L.dynamic_smem_bytes)[1]
    cfg, _ = k._config((L.cluster[0] * 132, 1, 1), 0, False)
    clusters = drv.cuOccupancyMaxActiveClusters(k.func, cfg)[1]
    return {"blocks_per_sm": blocks, "active_clusters": clusters}


def time_graph(name: str, closures: list) -> float:
    """us per layer: musekern bench's graph timing (timing.Graph, LOOPS copies of the closures, REPS samples
    taken round robin with a lead-in replay each), so sweeps and the bench measure alike."""
    g = Graph(name, closures, LOOPS, LAYERS)
    return time_graphs([g], REPS)[name]["us"]


def run(v: QkvFrontVariant, m: int, weights, bw: float, pred) -> dict:
    k = get_kernel(v)
    x = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
    pos = torch.randint(0, 4096, (m,), device="cuda")
    cs = torch.randn(4096, 64, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:m]
    kv = torch.zeros(2, 64, 16, v.num_kv_heads, 64, dtype=torch.bfloat16, device="cuda")
    outs = [torch.empty(m, v.n, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS if DISTINCT_OUT else 1)]
    args = [launch_args(x, w, pos, cs, slots, kv[0], kv[1], 1e-5, outs[j % len(outs)]) for j, w in enumerate(weights)]
    grid = launch_grid(v)
    row = {"label": v.label, "N": v.n, "M": m, "stages": v.stages, "splits": v.splits, "trigger": v.trigger,
           "l2_prefetch": v.l2_prefetch, "k_rotate": v.k_rotate, "warp_split": v.warp_split,
           "trigger_ahead": v.trigger_ahead, "stash": v.stash, **occupancy(k)}
    for mode, pdl in (("chain", True), ("isolated", False)):
        us = time_graph(mode, [lambda a=a, pdl=pdl: k.launch(grid, a, pdl=pdl) for a in args])
        row[f"{mode}_us"] = round(us, 2)
        row[f"{mode}_frac"] = round(v.n * HIDDEN * 2 / (us * 1e-6) / (bw * 1e12), 3)
    if pred is not None:  # after-norm: a PDL predecessor (writes x, triggers early) before every front
        gamma = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
        res = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
        pred_one = lambda: pred.launch(res, gamma, x, 1e-5)  # noqa: E731
        both = time_graph("after-norm", [f for a in args
                                         for f in (pred_one, lambda a=a: k.launch(grid, a, pdl=True))])
        alone = time_graph("pred", [pred_one] * len(args))
        row["after_norm_us"], row["pred_us"] = round(both, 2), round(alone, 2)
        row["added_us"] = round(both - alone, 2)  # per layer: graph launches pred+front per layer entry
    return row


TIMED = ("chain_us", "chain_frac", "isolated_us", "isolated_frac", "after_norm_us", "pred_us", "added_us")


def merge_repeats(runs: list) -> dict:
    """One row per job: the median of each timed field over the repeats, every sample under `samples`."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    row = dict(ok[0])
    for f in TIMED:
        if f in row:
            row[f] = round(statistics.median(r[f] for r in ok), 3)
    if len(runs) > 1:
        row["samples"] = {f: [r[f] for r in ok] for f in ("chain_us", "isolated_us", "added_us") if f in row}
    return row


def build_commit():
    """The commit the carried cache was built from (bench/gpu_cache.sh writes BUILD_INFO.json), as the bench
    reads it; "-dirty" when the tree had uncommitted changes."""
    info = commit_info()
    return info["commit"] and info["commit"] + ("-dirty" if info.get("dirty") else "")


def main(argv=None) -> int:
    global LOOPS, DISTINCT_OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", help="results JSON")
    ap.add_argument("--print-labels", action="store_true", help="print the default grid's labels (for prepare)")
    ap.add_argument("labels", nargs="*")
    ap.add_argument("--n", type=int)
    ap.add_argument("--kv", type=int)
    ap.add_argument("--stages", default="8")
    ap.add_argument("--splits", default="1")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--loops", type=int, default=8, help="copies of the 8-layer sequence per graph")
    ap.add_argument("--distinct-out", action="store_true", help="one y buffer per layer (musekern bench's setup)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole job list this many times, round-robin (A/B pairs see the same drift); "
                         "each row reports the medians and keeps every sample")
    a = ap.parse_args(argv)
    LOOPS, DISTINCT_OUT = a.loops, a.distinct_out
    if a.print_labels:
        print("\n".join(sorted({v.label for v, _ in grid_jobs()})))
        return 0
    ms = [int(x) for x in a.m.split(",")]
    jobs = [] if (a.labels or a.n) else grid_jobs()  # (variant, m)
    for lbl in a.labels:
        v = variant_from_label(lbl)
        jobs += [(v, m) for m in ms if token_tiles(m) == v.tiles and fixed_rows(m) == v.fixed_m]
    if a.n:
        for st, sp, m in itertools.product(a.stages.split(","), a.splits.split(","), ms):
            jobs.append((QkvFrontVariant(a.n, a.kv, token_tiles(m), int(st), int(sp), fixed_rows(m)), m))
    bw = copy_bandwidth()  # also makes torch's CUDA context current (the predecessor loads into it)
    try:
        from musekern.bench.pred import PredKernel

        pred = PredKernel()
    except Exception as e:  # no NVRTC/nvcc: chain and isolated only
        print(f"no predecessor kernel ({e}); after-norm skipped", file=sys.stderr)
        pred = None
    print(f"copy {bw:.3f} TB/s", file=sys.stderr)
    weights_by_n, samples = {}, {}
    for _ in range(a.repeat):
        for j, (v, m) in enumerate(jobs):
            if v.n not in weights_by_n:
                weights_by_n.clear()  # one N's layers at a time: bounded memory
                weights_by_n[v.n] = [(torch.randn(v.n, HIDDEN, device="cuda") / 90).to(torch.bfloat16)
                                     for _ in range(LAYERS)]
            try:
                row = run(v, m, weights_by_n[v.n], bw, pred)
            except Exception as e:  # a variant missing from the cache: report it, go on
                row = {"label": v.label, "M": m, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            samples.setdefault(j, []).append(row)
            print(json.dumps(row), file=sys.stderr)
    rows = [merge_repeats(samples[j]) for j in range(len(jobs))]
    json.dump({"commit": build_commit(), "command": "python3 bench/sweep_variants.py " + " ".join(sys.argv[1:]),
               "copy_TBps": round(bw, 3), "device": torch.cuda.get_device_name(), "repeats": a.repeat, "rows": rows},
              open(a.out, "w"), indent=1)
    print(f"{'N':>5} {'S':>2} {'st':>2} {'trig':5} {'ahd':>3} {'sts':>3} {'pf':>3} {'rot':>3} {'warps':5} "
          f"{'M':>3} {'blk/SM':>6} "
          f"{'chain us':>9} {'frac':>6} {'isol us':>8} {'frac':>6} {'added us':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['label']:72} {r['M']:3} ERROR {r['error'][:60]}")
        else:
            print(f"{r['N']:5} {r['splits']:2} {r['stages']:2} {r['trigger']:5} {r.get('trigger_ahead', 0):3} "
                  f"{r.get('stash', 0):3} {r['l2_prefetch']:3} {r['k_rotate']:3} "
                  f"{r.get('warp_split', 'rows'):5} "
                  f"{r['M']:3} "
                  f"{r['blocks_per_sm']:6} "
                  f"{r['chain_us']:9} {r['chain_frac']:6} {r['isolated_us']:8} {r['isolated_frac']:6} "
                  f"{r.get('added_us', '-'):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
