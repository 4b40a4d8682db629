#!/usr/bin/env python3
"""What the fused epilogue adds after each cuBLAS algorithm of the GEMM path (bench/NOTES.md "Every M: the GEMM's
algorithm": after the unsplit kernels the GEMM path minus the GEMM alone is 2.3-3.0 us, after split-K 0.6-1.4).

Per (N, M): torch.mm and every algorithm cuBLASLt's heuristic offers (gemm/tune.py's candidates), each in a CUDA graph
of 8 layers (weights rotated past the L2, as `tune` and the bench time them), replayed 7 times, medians, us a layer:
- `alone`: the GEMM only (what `tune` times);
- `epi`: the GEMM, then the planned epilogue build on y (PDL, as the product launches it);
- `epi_nopdl`: the same epilogue launched without PDL;
- `null`: the GEMM, then a one-element fill of y (a kernel between GEMMs that does no work).
If `null` - `alone` is as large as `epi` - `alone`, the cost is the kernel boundary, not the epilogue's work; if the
order of the candidates by `epi` differs from their order by `alone`, `tune` times the wrong thing.

  python3 bench/probes/epilogue_after_gemm.py [--out FILE] [--shape N,M ...]      (on the GPU machine)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from issue13_table import _inputs, write_results  # noqa: E402

import musekern  # noqa: E402
from musekern.gemm import cublaslt  # noqa: E402
from musekern.gemm import tune as G  # noqa: E402
from musekern.kernels.qkv_front.variant import HIDDEN  # noqa: E402
from musekern.ops import checks as CH  # noqa: E402
from musekern.ops import qkv_epilogue as E  # noqa: E402

KV = {2176: 1, 4352: 2, 17408: 8}
# the GEMM path's decode Ms where unsplit (TP4) and split-K (TP8) picks win, TP1 above its front
SHAPES = ((2176, 65), (2176, 128), (2176, 256), (4352, 65), (4352, 128), (4352, 256), (17408, 64), (17408, 128))
ROUNDS = 7  # graph replays a median is taken over (gemm/tune.py's timing: 8 calls a graph)


def shape_rows(n: int, m: int, dev: int) -> list:
    nkv = KV[n]
    p = _inputs(n, nkv, m, torch.Generator(device="cuda").manual_seed(m))
    musekern.prepare_ops(n, [m], num_kv_heads=nkv)
    layers = max(2, -(-2 * torch.cuda.get_device_properties(dev).L2_cache_size // (n * HIDDEN * 2)))
    W = [torch.randn(n, HIDDEN, device="cuda").div_(90).to(torch.bfloat16) for _ in range(layers)]
    x = p["x"]
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    key = (n, m, nkv, dev)
    tok = (p["positions"], p["slot_mapping"], p["cos_sin_cache"], p["key_cache"], p["value_cache"])
    tc = CH.fast_token_cache_values(m, dev, nkv, *tok, y.data_ptr(), y.data_ptr() + m * n * 2)
    v = E.epilogue_variant(n, m, nkv)
    kernel, order = E._loaded(v, dev)
    nopdl = kernel.launcher(E.launch_grid(v, m, n, nkv), take=order, pdl=False)
    y0 = y.data_ptr()
    vals = lambda: [y0, *tc[:5], m, (n // 64 - 2 * nkv) // 2, nkv, n, *tc[5:], 1e-6]  # noqa: E731 (launch_read's)
    after = {
        "alone": lambda: None,
        "epi": lambda: E.launch_read(key, y0, tc, 1e-6),
        "epi_nopdl": lambda: nopdl(vals()),
        "null": lambda: y[:1, :1].zero_(),
    }
    mat = cublaslt.Matmul(cublaslt.library(), n, m, dev)
    cands = mat.candidates()
    ws = torch.empty(max([c.workspace for c in cands] + [1]), dtype=torch.uint8, device="cuda")
    gemms = {"mm": lambda w: torch.mm(x, w.t(), out=y)}
    for c in cands:
        f = mat.launcher(c)
        gemms[c.name] = lambda w, f=f: f(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(),
                                          G._stream(dev))
    rows = []
    for name, gm in gemms.items():
        r = {"N": n, "M": m, "gemm": name}
        try:
            for k, a in after.items():
                r[k] = round(G._time(lambda w, gm=gm, a=a: (gm(w), a()), W, ROUNDS), 3)
        except RuntimeError as e:
            r["error"] = str(e)[:120]
        rows.append(r)
    del W
    torch.cuda.empty_cache()
    return rows


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shape", action="append", help="N,M (repeatable; default: SHAPES)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape] if args.shape else SHAPES
    dev = torch.cuda.current_device()
    rows = []
    for n, m in shapes:
        got = shape_rows(n, m, dev)
        rows += got
        print(json.dumps(got), file=sys.stderr, flush=True)
    print("us a layer (8 layers in a graph, medians): GEMM alone | + epilogue (PDL) | + epilogue (no PDL) | "
          "+ null kernel")
    for n, m in shapes:
        rs = sorted((r for r in rows if r["N"] == n and r["M"] == m and "alone" in r), key=lambda r: r["epi"])
        best_alone = min(rs, key=lambda r: r["alone"])["gemm"]
        print(f"N={n} M={m}: best alone {best_alone}, best with the epilogue {rs[0]['gemm']}")
        for r in rs[:6] + [r for r in rs[6:] if r["gemm"] in ("mm", best_alone)]:
            print(f"    {r['gemm']:<36} {r['alone']:7.2f} {r['epi']:7.2f} (+{r['epi'] - r['alone']:4.2f}) "
                  f"{r['epi_nopdl']:7.2f} {r['null']:7.2f} (+{r['null'] - r['alone']:4.2f})")
    write_results(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
