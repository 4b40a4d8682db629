#!/usr/bin/env python3
"""Which setup difference makes the all-M table's epilogue slower than the epilogue bench's (bench/NOTES.md
"qkv_epilogue"): the planned qkv_epilogue build alone, graph replay medians, at the all-M table's large cells, under
the 2 x 2 x 2 combinations of
  cache   "allm": twice the slots the tokens take, randn-filled, M of them chosen at random
          (bench/harness/all_m.py); "epi": the tokens' slots rounded up to a block plus one block, zero-filled, a
          permutation (bench/epilogue_bench.py)
  ys      8 y buffers (all-M: one per layer) or as many as fill 256 MB (the epilogue bench, at least 1, at most 8)
  table   4096 (all-M) or 8192 (epilogue bench) cos|sin rows, positions drawn over the table
and a device copy of the epilogue's bytes in the same samples. Prints a table; --out writes JSON (commit, device).

  python3 bench/probes/epilogue_setups.py [--out FILE]       (on the GPU machine; the carried cache)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch

from bench.harness.report import commit_info
from bench.harness.timing import Graph, copy_bandwidth, copy_closures, loops_for, time_graphs
from musekern.config import load_config
from musekern.kernels.qkv_epilogue.variant import epilogue_bytes
from musekern.ops import qkv_epilogue as op
from musekern.reference import rope_cos_sin_table

BLOCK_SIZE = 16
CELLS = ((2176, 1, 16384), (4352, 2, 16384), (17408, 8, 4096), (17408, 8, 16384))


def _cache(kind: str, m: int, nkv: int, g):
    if kind == "allm":
        blocks = max(64, -(-m // BLOCK_SIZE) * 2)
        kv = torch.randn(2, blocks, BLOCK_SIZE, nkv, 64, device="cuda", generator=g).to(torch.bfloat16)
        slots = torch.randperm(blocks * BLOCK_SIZE, device="cuda", generator=g)[:m]
    else:
        cap = (m + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE + BLOCK_SIZE
        kv = torch.zeros(2, cap // BLOCK_SIZE, BLOCK_SIZE, nkv, 64, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(cap, device="cuda", generator=g)[:m]
    return kv, slots


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = load_config()
    tbps = copy_bandwidth()
    rows = []
    for n, nkv, m in CELLS:
        g = torch.Generator(device="cuda").manual_seed(n + m)
        nbytes = epilogue_bytes(m, n, nkv)
        graphs = []
        keep = []
        for cache, ys_kind, table in itertools.product(("allm", "epi"), ("8", "fill"), (4096, 8192)):
            kv, slots = _cache(cache, m, nkv, g)
            cs = rope_cos_sin_table(table, model.rope_theta, "cuda")
            pos = torch.randint(0, table, (m,), device="cuda", generator=g)
            nbuf = 8 if ys_kind == "8" else max(1, min(8, math.ceil((256 << 20) / (m * n * 2))))
            ys = [torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16) for _ in range(nbuf)]
            keep.append((kv, slots, cs, pos, ys))
            closures = [(lambda y=y, kv=kv, slots=slots, cs=cs, pos=pos, nkv=nkv:
                         op.launch(y, pos, cs, slots, kv[0], kv[1], nkv, model.rms_norm_eps)) for y in ys]
            loops = loops_for(nbuf * nbytes / (tbps * 1e12), max_loops=512)
            graphs.append(Graph(f"{cache}/{ys_kind}/{table}", closures, loops, nbuf))
        graphs.append(Graph("copy", copy_closures(nbytes, 8), loops_for(8 * nbytes / (tbps * 1e12), max_loops=512), 8))
        t = time_graphs(graphs, 5)
        row = {"N": n, "M": m, "bytes": nbytes, **{k: round(v["us"], 3) for k, v in t.items()}}
        rows.append(row)
        print(f"N={n} M={m}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float)),
              file=sys.stderr, flush=True)
        del graphs, keep
        torch.cuda.empty_cache()
    names = [k for k in rows[0] if "/" in k] + ["copy"]
    print(f"epilogue us by setup (cache/ys/table), copy {tbps:.2f} TB/s")
    print(f"{'N':>6} {'M':>6} " + " ".join(f"{k:>15}" for k in names))
    for r in rows:
        print(f"{r['N']:>6} {r['M']:>6} " + " ".join(f"{r[k]:>15.2f}" for k in names))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**commit_info(), "device": torch.cuda.get_device_name(), "copy_TBps": tbps, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
