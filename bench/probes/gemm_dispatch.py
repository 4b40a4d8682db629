#!/usr/bin/env python3
"""Which way of asking cuBLAS for y = x @ W^T is fastest at each (N, M) of the GEMM path (bench/NOTES.md "Every M"):
cuBLAS's own kernel choice steps where the bytes do not (TP4 M = 65 26.8 us against 23.3 at M = 128, TP1 56 -> 57
+5.3 us; `bench/results/h200-bench.json`). Per (N, M), graph replay over 8 layers of distinct weights, medians, side by
side in one run:

- mm:       torch.mm(x, W^T, out=y)                          (the product's GEMM path today: cublasGemmEx)
- lt_bias:  torch.addmm(zeros[N], x, W^T, out=y)             (torch routes a 1-D bias to cublasLt's gemm + bias)
- lt:       torch.mm under preferred_blas_library("cublaslt") (cublasLt's heuristic, no bias)
- pad<P>:   x copied into a [ceil(M / P) * P, 8192] buffer, torch.mm on it (y the first M rows), the copy included
            (--pad)

Every method's y is checked against mm's (fp32 accumulation in both: max relative difference recorded), and the
kernels one call of it launches are recorded (torch.profiler).

  python3 bench/probes/gemm_dispatch.py OUT.json [--n 2176,4352,17408] [--m 48,56,...] [--pad]   (GPU machine)
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.harness.report import commit_info
from bench.harness.timing import Graph, copy_bandwidth, loops_for, time_graphs

HIDDEN, LAYERS = 8192, 8
MS = (48, 56, 57, 64, 65, 72, 80, 96, 112, 128, 129, 160, 192, 256)
NS = (2176, 4352, 17408)


def _lt(f):
    """f run with cuBLASLt as torch's BLAS backend (captured kernels keep the choice)."""
    def g():
        prev = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            f()
        finally:
            torch.backends.cuda.preferred_blas_library(prev)
    return g


def kernel_names(f) -> list[str]:
    """The CUDA kernels one call of f launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "emory" not in e.name]


def methods(n: int, m: int, W: list, x: torch.Tensor, pad: bool) -> dict:
    """name -> (closures over the 8 layers, the y each leaves for layer 0's check)."""
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    zb = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    out = {"mm": ([lambda w=w: torch.mm(x, w.t(), out=y) for w in W], y),
           "lt_bias": ([lambda w=w: torch.addmm(zb, x, w.t(), out=y) for w in W], y),
           "lt": ([_lt(lambda w=w: torch.mm(x, w.t(), out=y)) for w in W], y)}
    for p in (64, 128) if pad else ():
        mp = -(-m // p) * p
        if mp == m:
            continue
        xp = torch.zeros(mp, HIDDEN, dtype=torch.bfloat16, device="cuda")
        yp = torch.empty(mp, n, dtype=torch.bfloat16, device="cuda")

        def step(w, xp=xp, yp=yp):
            xp[:m].copy_(x)
            torch.mm(xp, w.t(), out=yp)
        out[f"pad{p}"] = ([lambda w=w, s=step: s(w) for w in W], yp[:m])
    return out


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", default=",".join(map(str, NS)))
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--pad", action="store_true", help="also time M padded to 64 / 128 rows (a copy of x first)")
    a = ap.parse_args(argv)
    ns, ms = [int(v) for v in a.n.split(",")], [int(v) for v in a.m.split(",")]
    torch.manual_seed(0)
    copy = copy_bandwidth()
    rows = []
    for n in ns:
        W = [torch.randn(n, HIDDEN, device="cuda").div_(HIDDEN ** 0.5).to(torch.bfloat16) for _ in range(LAYERS)]
        for m in ms:
            x = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
            ref = None
            graphs, errs, names = [], {}, {}
            for name, (closures, y) in methods(n, m, W, x, a.pad).items():
                closures[0]()
                torch.cuda.synchronize()
                got = y.float()
                if ref is None:
                    ref = got.clone()
                errs[name] = float(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
                names[name] = kernel_names(closures[1])
                est = n * HIDDEN * 2 / (copy * 1e12) * 1.5  # the weight stream, seconds a layer (loops only)
                graphs.append(Graph(name, closures, loops_for(est * LAYERS), LAYERS))
            t = time_graphs(graphs, a.samples)
            row = {"N": n, "M": m, "us": {k: round(v["us"], 3) for k, v in t.items()},
                   "samples": {k: v["samples"] for k, v in t.items()}, "max_rel_diff_vs_mm": errs, "kernels": names}
            rows.append(row)
            best = min(row["us"], key=row["us"].get)
            print(f"N={n:5d} M={m:4d} " + " ".join(f"{k}={v:7.2f}" for k, v in row["us"].items())
                  + f"  best={best}", file=sys.stderr, flush=True)
            del graphs
        del W
        torch.cuda.empty_cache()
    res = {**commit_info(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_TBps": copy, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    names = sorted({k for r in rows for k in r["us"]})
    print("N      M     " + " ".join(f"{k:>8s}" for k in names))
    for r in rows:
        print(f"{r['N']:5d} {r['M']:5d} " + " ".join(f"{r['us'].get(k, float('nan')):8.2f}" for k in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
