#!/usr/bin/env python3
"""Time qkv_front builds that differ from the plan (ring depth, k_split) side by side, on the GPU.

Usage (GPU machine, cache carried): python3 bench/sweep_variants.py OUT.json [LABEL ...]   (default: GRID)
  or  python3 bench/sweep_variants.py OUT.json --n 8704 --kv 4 --stages 3,4,5,8 --k-split 1 --m 1,16

Per variant and M: a CUDA graph of 8 launches over 8 distinct weights (streams from HBM, not L2),
with PDL (chain) and without (isolated), timed like the bench harness (bench/harness/timing.py: median of
7 samples; rounds 1-13 of bench/HISTORY.md used this script's own replay loop, same graphs); us per launch and
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

from bench.harness.report import commit_info
from bench.harness.timing import Graph, copy_bandwidth, time_graphs
from musekern.kernels.qkv_front.rules import fixed_rows, token_tiles
from musekern.kernels.qkv_front.variant import HIDDEN, TOKEN_TILE, QkvFrontVariant, launch_grid
from musekern.ops.qkv_front import launch_args
from musekern.plan import variant_from_label
from musekern.runtime import get_kernel
from musekern.runtime.driver import launch_config
from musekern.targets import get_target

H200 = get_target("h200")  # the grid's tile counts are the H200's

LAYERS, REPS, LOOPS = 8, 7, 8
DISTINCT_OUT = False  # --distinct-out: one y buffer per layer (as the bench harness does) instead of a shared one
# The default grid is the latest tuning round's (round 25: TP4 at k_split 1 with the deep ring, TP8's grid shape,
# against the plan, which it kept: bench/NOTES.md, k_split). Every earlier round's grid, prediction and result is in
# bench/HISTORY.md (the grids themselves: `git log -p bench/sweep_variants.py`).
# Each entry: the variant's fields except tiles and fixed_rows (from M), and the Ms to time.
TP4 = dict(n=4352, num_kv_heads=2)
GRID = [(dict(TP4, k_split=2, stages=4, trigger="exit", warp_split="k"), (1, 16))] \
    + [(dict(TP4, k_split=1, stages=11, trigger="late", trigger_ahead=a, warp_split=ws), (1,))
       for ws, a in (("rows", 6), ("rows", 8), ("rows", 11), ("rows", 16), ("k", 8))] \
    + [(dict(TP4, k_split=1, stages=10, trigger="late", trigger_ahead=a, warp_split="k"), (16,)) for a in (8, 11)]


def grid_jobs():
    return [(QkvFrontVariant(tiles=token_tiles(m, fields["n"], H200), fixed_rows=fixed_rows(m), **fields), m)
            for fields, ms in GRID for m in ms]


def holds(v, m: int) -> bool:
    """Does build `v` take a call of M tokens (M within its padded tokens, the M == 8 build only M = 8)?"""
    return (m + TOKEN_TILE - 1) // TOKEN_TILE <= v.tiles and fixed_rows(m) == v.fixed_rows


def occupancy(k) -> dict:
    L = k.abi.launch
    blocks = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.func, L.block[0], L.dynamic_smem_bytes)[1]
    cfg = launch_config((L.cluster[0] * 132, 1, 1), L.block, L.dynamic_smem_bytes, 0, L.cluster, False)
    clusters = drv.cuOccupancyMaxActiveClusters(k.func, cfg)[1]
    return {"blocks_per_sm": blocks, "active_clusters": clusters}


def time_graph(name: str, closures: list) -> float:
    """us per layer: the bench harness's graph timing (timing.Graph, LOOPS copies of the closures, REPS samples
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
    row = {"label": v.label, "N": v.n, "M": m, "stages": v.stages, "k_split": v.k_split, "trigger": v.trigger,
           "warp_split": v.warp_split, "trigger_ahead": v.trigger_ahead, **occupancy(k)}
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
    ap.add_argument("--k-split", default="1")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--loops", type=int, default=8, help="copies of the 8-layer sequence per graph")
    ap.add_argument("--distinct-out", action="store_true", help="one y buffer per layer (the bench harness's setup)")
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
        jobs += [(v, m) for m in ms if holds(v, m)]
    if a.n:
        if max(ms) > 16:  # (above, a build's tile count and warp split depend on S: give labels)
            ap.error("--n builds the decode variants (M <= 16, mma.sync); give labels for larger M")
        for st, sp, m in itertools.product(a.stages.split(","), a.k_split.split(","), ms):
            jobs.append((QkvFrontVariant(a.n, a.kv, token_tiles(m, a.n, H200), int(st), int(sp), fixed_rows(m)), m))
    bw = copy_bandwidth()  # also makes torch's CUDA context current (the predecessor loads into it)
    try:
        from bench.harness.pred import PredKernel

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
    print(f"{'N':>5} {'S':>2} {'st':>2} {'trig':5} {'ahd':>3} {'warps':5} "
          f"{'M':>3} {'blk/SM':>6} "
          f"{'chain us':>9} {'frac':>6} {'isol us':>8} {'frac':>6} {'added us':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['label']:72} {r['M']:3} ERROR {r['error'][:60]}")
        else:
            print(f"{r['N']:5} {r['k_split']:2} {r['stages']:2} {r['trigger']:5} {r.get('trigger_ahead', 0):3} "
                  f"{r.get('warp_split', 'rows'):5} "
                  f"{r['M']:3} "
                  f"{r['blocks_per_sm']:6} "
                  f"{r['chain_us']:9} {r['chain_frac']:6} {r['isolated_us']:8} {r['isolated_frac']:6} "
                  f"{r.get('added_us', '-'):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
