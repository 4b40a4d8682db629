#!/usr/bin/env python3
"""qkv_epilogue timing on the GPU: CUDA-graph replay, medians, copy bandwidth measured in the same run.

Per (N, M), each a graph of `layers` launches replayed until >= 1.5 ms of GPU work (bench.harness.timing):
  epi          the fused epilogue alone, the build the planner picks (y rotated over enough buffers to leave the L2)
  epi_<k>x<r>  the same with each build of the sweep (vecs_per_thread k, rounds r: the data of the planner's rule)
  copy         torch's device copy of as many bytes (read + written) as the epilogue moves, over as many rotated
               buffers: the streaming reference in the same samples (the 2 GiB copy_TBps is measured once, first)
  mm           torch.mm (cuBLAS) alone, y = x @ W^T, W rotated over the layers' distinct weights
  mm_epi       torch.mm + the fused epilogue (its PDL launch attribute, as planned)
  mm_epi_nopdl torch.mm + the fused epilogue launched without PDL
  mm_unfused   torch.mm + the unfused torch epilogue (bench/harness/unfused.py: no host sync)
  mm_compiled  torch.mm + torch.compile(musekern.reference.fused_qknorm_rope_kv_insert, dynamic=True), M >= 2 (M = 1
               would compile once more per N: torch specializes sizes 0 and 1)
Bytes of the epilogue: musekern.kernels.qkv_epilogue.variant.epilogue_bytes (y's q|k read and written, v read, k|v cache
rows written, positions, slots, cos|sin rows). All slots valid (the unfused baseline needs that).

  python3 bench/epilogue_bench.py --out DIR [--ns 2176,4352,17408] [--ms 1,16,...] [--sweep-s 75] [--baselines-s 55]
Writes DIR/h200-epilogue-bench.json (commit, device, every number) after every row; prints the table last. Within a
device call's time: past --sweep-s of wall time the builds sweep, past --baselines-s the unfused / compiled / no-PDL
baselines are left out (the row says so); epi, mm and mm_epi are always measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from bench.harness.report import commit_info
from bench.harness.timing import Graph, copy_bandwidth, copy_closures, log, loops_for, time_graphs
from bench.harness.unfused import unfused_epilogue
from musekern.config import load_config
from musekern.kernels.qkv_epilogue.variant import (
    QkvEpilogueVariant,
    all_builds,
    epilogue_bytes,
    epilogue_variant,
    launch_grid,
)
from musekern.ops import qkv_epilogue as op
from musekern.reference import fused_qknorm_rope_kv_insert, rope_cos_sin_table

HIDDEN = 8192
EPS = 1e-6
MAX_POS = 8192
BLOCK_SIZE = 16
ROTATE_BYTES = 256 << 20  # y bytes the epilogue-alone graphs rotate over: far above the 60 MB L2
MMA_TFLOPS = 700e12  # for the graph-length estimate only
# the builds swept: every vecs_per_thread of one round, and the rounds with one and two vectors a thread (more
# vectors with rounds > 1 take 114 / 165 registers: 2 / 1 CTAs an SM)
SWEEP = tuple(b for b in all_builds() if b.vecs_per_thread <= 2 or b.rounds == 1)


def _name(b: QkvEpilogueVariant) -> str:
    return f"epi_{b.vecs_per_thread}x{b.rounds}"


def _problem(n: int, nkv: int, m: int, g: torch.Generator) -> dict:
    cap = (m + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE + BLOCK_SIZE
    kv = torch.zeros(2, cap // BLOCK_SIZE, BLOCK_SIZE, nkv, 64, dtype=torch.bfloat16, device="cuda")
    return dict(positions=torch.randint(0, MAX_POS, (m,), device="cuda", generator=g),
                cos_sin_cache=rope_cos_sin_table(MAX_POS, 500000.0, "cuda"),
                slot_mapping=torch.randperm(cap, device="cuda", generator=g)[:m], key_cache=kv[0],
                value_cache=kv[1], num_kv_heads=nkv, eps=EPS)


def _timed(graphs: list, samples: int) -> dict:
    t = time_graphs(graphs, samples, reps=2 if samples > 3 else 1)
    out = {name: r["us"] for name, r in t.items()}
    for g in graphs:
        del g.graph
    return out


def measure(n: int, nkv: int, m: int, weights: list, copy_tbps: float, compiled, sweep: bool, baselines: bool) -> dict:
    """One row: us per launch of every configuration at (N, M)."""
    g = torch.Generator(device="cuda").manual_seed(n + m)
    p = _problem(n, nkv, m, g)
    nbytes = epilogue_bytes(m, n, nkv)
    epi_s = max(nbytes / (copy_tbps * 1e12), 2e-6)
    samples = 5 if m <= 4096 else 3
    row = {"N": n, "num_kv_heads": nkv, "M": m, "bytes": nbytes,
           "build": epilogue_variant(n, m, nkv).label, "grid": launch_grid(epilogue_variant(n, m, nkv), m, n, nkv)[0]}
    # the epilogue alone, over rotated y buffers (in place: every launch re-norms them; values stay normed)
    nbuf = max(1, min(8, math.ceil(ROTATE_BYTES / (m * n * 2))))
    ys = [torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16) for _ in range(nbuf)]
    builds = [None] + (list(SWEEP) if sweep else [])
    graphs = []
    for b in builds:
        name = "epi" if b is None else _name(b)
        closures = [(lambda y=y, b=b: op.launch(y, **p, variant=b)) for y in ys]
        graphs.append(Graph(name, closures, loops_for(nbuf * epi_s, max_loops=512), nbuf))
    graphs.append(Graph("copy", copy_closures(nbytes, nbuf), loops_for(nbuf * epi_s, max_loops=512), nbuf))
    row.update(_timed(graphs, samples))
    del ys
    if row.get("copy"):
        row["copy_TBps_same_bytes"] = round(nbytes / (row["copy"] * 1e-6) / 1e12, 4)
        for k in [k for k in row if k.startswith("epi") and isinstance(row[k], float)]:
            row[f"{k}_frac_same_bytes_copy"] = round(row["copy"] / row[k], 4)
    # torch.mm and what follows it, over the layers' weights
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    v = epilogue_variant(n, m, nkv)
    kernel = op._loaded(v, torch.cuda.current_device())[0]
    args = op.launch_args(y, **p)
    grid = launch_grid(v, m, n, nkv)
    mm_s = 2 * m * n * HIDDEN / MMA_TFLOPS + (n * HIDDEN + m * HIDDEN + m * n) * 2 / (copy_tbps * 1e12) + 3e-6
    seqs = {
        "mm": lambda w: torch.mm(x, w.t(), out=y),
        "mm_epi": lambda w: (torch.mm(x, w.t(), out=y), op.launch(y, **p)),
    }
    if baselines:
        seqs["mm_epi_nopdl"] = lambda w: (torch.mm(x, w.t(), out=y), kernel.launch(grid, args, pdl=False))
        seqs["mm_unfused"] = lambda w: unfused_epilogue(torch.mm(x, w.t()), **p)
        if compiled is not None and m >= 2:
            seqs["mm_compiled"] = lambda w: compiled(torch.mm(x, w.t()), **p)
    graphs = []
    for name, f in seqs.items():
        try:
            graphs.append(Graph(name, [(lambda w=w, f=f: f(w)) for w in weights], loops_for(len(weights) * (
                mm_s + 2 * epi_s)), len(weights)))
        except Exception as e:  # a baseline that cannot be captured is reported, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  {name} at N={n} M={m}: {row[f'{name}_error']}")
    row.update(_timed(graphs, samples))
    if row.get("epi"):
        row["epi_frac_copy_bw"] = round(nbytes / (row["epi"] * 1e-6) / (copy_tbps * 1e12), 4)
    if row.get("mm_epi") and row.get("mm"):
        row["mm_epi_over_mm"] = round(row["mm_epi"] / row["mm"], 4)
        for k in ("mm_unfused", "mm_compiled"):
            if k in row:
                row[f"{k}_over_mm_epi"] = round(row[k] / row["mm_epi"], 3)
    return row


def _write(doc: dict, path: str) -> None:
    """After every row: a call stopped at its time limit still brings back what was measured."""
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)


def _table(doc: dict) -> str:
    sweep = [_name(b) for b in SWEEP]
    cols = ["N", "M", "build", "epi", "frac", "copy", "mm", "mm_epi", "ratio", "nopdl", "unfused", "compiled"] + [
        n[4:] for n in sweep]
    lines = [f"qkv_epilogue bench: {doc['device']} commit {str(doc['commit'])[:12]} copy {doc['copy_TBps']:.2f} TB/s"
             " (us per launch, graph replay medians; frac = epilogue bytes / time / copy bandwidth)",
             "  ".join(f"{c:>8}" for c in cols)]
    for r in doc["rows"]:
        f = lambda k, fmt="{:.2f}", r=r: fmt.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        vals = [str(r["N"]), str(r["M"]), r["build"].split("[")[-1].rstrip("]"), f("epi"), f("epi_frac_copy_bw"),
                f("copy"), f("mm"), f("mm_epi"), f("mm_epi_over_mm", "{:.3f}"), f("mm_epi_nopdl"), f("mm_unfused"),
                f("mm_compiled")] + [f(n) for n in sweep]
        lines.append("  ".join(f"{v:>8}" for v in vals))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("DEST", "bench/results"))
    ap.add_argument("--name", default="h200-epilogue-bench.json")
    ap.add_argument("--ns", default="2176,17408,4352")
    ap.add_argument("--ms", default="1,16,17,32,64,128,256,1024,4096,16384,65536")
    ap.add_argument("--layers", type=int, default=8, help="distinct weights per graph (M <= 4096; 2 above)")
    ap.add_argument("--sweep-s", type=float, default=75.0, help="no builds sweep past this wall time")
    ap.add_argument("--baselines-s", type=float, default=55.0, help="no unfused / compiled / no-PDL past this")
    a = ap.parse_args()
    t0 = time.perf_counter()
    cfg = load_config()
    kv_of = {s.n: s.num_kv_heads for s in cfg.shards()}
    ns = [int(v) for v in a.ns.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    copy_tbps = copy_bandwidth(samples=5, nbytes=1 << 30)
    log(f"copy bandwidth {copy_tbps:.2f} TB/s")
    for n in ns:
        op.prepare(n, ms, num_kv_heads=kv_of[n])
        for b in SWEEP:
            op._loaded(b, torch.cuda.current_device())[0]
    compiled, compile_error = None, None
    try:
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False  # else M == block_size (16) shares a symbol with it: one more compile
        compiled = torch.compile(fused_qknorm_rope_kv_insert, dynamic=True, fullgraph=True)
    except Exception as e:
        compile_error = f"{type(e).__name__}: {e}"
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, a.name)
    dev = torch.cuda.get_device_properties(0)
    doc = {**commit_info(), "device": dev.name, "sm_count": dev.multi_processor_count, "torch": torch.__version__,
           "copy_TBps": copy_tbps, "eps": EPS, "block_size": BLOCK_SIZE, "compile_error": compile_error, "rows": []}
    for n in ns:
        g = torch.Generator(device="cuda").manual_seed(n)
        weights = [(torch.randn(n, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5).to(torch.bfloat16)
                   for _ in range(a.layers)]
        for m in ms:
            now = time.perf_counter() - t0
            sweep, baselines = now < a.sweep_s, now < a.baselines_s
            w = weights if m <= 4096 else weights[:2]
            try:
                row = measure(n, kv_of[n], m, w, copy_tbps, compiled, sweep, baselines)
            except Exception as e:
                row = {"N": n, "M": m, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            row.update(sweep=sweep, baselines=baselines, wall_s=round(time.perf_counter() - t0, 1))
            doc["rows"].append(row)
            _write(doc, path)
            log(f"[{time.perf_counter() - t0:6.1f}s] N={n} M={m}: " + json.dumps(
                {k: v for k, v in row.items() if k in ("epi", "mm", "mm_epi", "epi_frac_copy_bw", "error")}))
            torch.cuda.empty_cache()
        del weights
    _write(doc, path)
    print(_table({**doc, "rows": [r for r in doc["rows"] if "error" not in r]}))
    for r in doc["rows"]:
        if "error" in r:
            print(f"N={r['N']} M={r['M']}: {r['error']}")
    print(f"-> {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
