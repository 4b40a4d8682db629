#!/usr/bin/env python3
"""Every algorithm cuBLASLt's heuristic offers for y = x @ W^T at each (N, M) of the GEMM path, timed (bench/NOTES.md
"Every M"): torch.mm takes the heuristic's first answer, which steps where the bytes do not (TP4 M = 65: 27.3 us with
torch.mm, 40.4 with cuBLASLt's first algorithm, 22.0 at M = 80; `bench/results/h200-gemm-dispatch.json`). Is there an
algorithm in the list that is fast at every M? Per (N, M): the algorithms the heuristic offers with a workspace of 32,
4, 1 and 0 MiB (at most 8 each), each captured in a CUDA graph over 8 layers of distinct weights, medians, beside
torch.mm; per algorithm its kernels (torch.profiler), workspace, tile and split-K, and its y against torch.mm's.

cuBLASLt is called through the product's binding (`musekern/gemm/cublaslt.py`: the candidates `gemm.tune.tune`
chooses among). h200-cublaslt-algos.json was taken at cf464f5 with this probe's own ctypes binding, which also
recorded each algorithm's config id, stages and waves (the same ids and stages everywhere).

  python3 bench/probes/cublaslt_algos.py OUT.json [--n 2176,4352,8704,17408] [--m 16,64,65,...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gemm_dispatch import kernel_names  # noqa: E402

from bench.harness.report import commit_info  # noqa: E402
from bench.harness.timing import Graph, time_graphs  # noqa: E402
from musekern.gemm import cublaslt  # noqa: E402
from musekern.kernels.qkv_front.variant import HIDDEN  # noqa: E402

LAYERS, LOOPS = 8, 6
MS = (1, 16, 17, 24, 32, 33, 48, 49, 56, 57, 64, 65, 72, 80, 88, 96, 112, 128, 192, 256)
NS = (2176, 4352, 8704, 17408)


def measure(lib, W: list, n: int, m: int, samples: int) -> dict:
    """One (N, M): torch.mm and every algorithm the heuristic offers (`Matmul.candidates`), timed side by side."""
    dev = torch.cuda.current_device()
    x = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    ref = torch.mm(x, W[0].t()).float()
    mat = cublaslt.Matmul(lib, n, m, dev)
    cands = mat.candidates()
    ws = torch.empty(max([c.workspace for c in cands] + [1]), dtype=torch.uint8, device="cuda")
    graphs = [Graph("mm", [lambda w=w: torch.mm(x, w.t(), out=y) for w in W], LOOPS, LAYERS)]
    info, calls = {"mm": {}}, {"mm": lambda: torch.mm(x, W[1].t(), out=y)}
    for i, c in enumerate(cands):
        run = mat.launcher(c)
        f = [lambda w=w, run=run: run(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(),
                                      torch.cuda.current_stream().cuda_stream) for w in W]
        try:
            f[0]()
            torch.cuda.synchronize()
        except cublaslt.CublasLtError as e:  # an algorithm the heuristic offered but the call refuses
            info[f"a{i}"] = {"name": c.name, "error": str(e)}
            continue
        diff = float(((y.float() - ref).abs().max() / ref.abs().max()).item())
        info[f"a{i}"] = {"name": c.name, "workspace": c.workspace, "config": {"tile": c.tile, "splitk": c.splitk},
                         "max_rel_diff_vs_mm": diff}
        calls[f"a{i}"] = f[1]
        graphs.append(Graph(f"a{i}", f, LOOPS, LAYERS))
    t = time_graphs(graphs, samples)
    for k, v in t.items():
        info[k]["us"] = round(v["us"], 3)
    timed = sorted(t, key=lambda k: info[k]["us"])
    for k in {"mm", "a0", *timed[:3]} & set(t):
        info[k]["kernels"] = kernel_names(calls[k])
    best = timed[0]
    print(f"N={n:5d} M={m:4d} mm={info['mm']['us']:7.2f} a0={info.get('a0', {}).get('us', float('nan')):7.2f}"
          f" best={best} {info[best]['us']:7.2f} {info[best]['kernels'][:1]} of {len(cands)}",
          file=sys.stderr, flush=True)
    return {"N": n, "M": m, "algos": info, "best": best}


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", default=",".join(map(str, NS)))
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--samples", type=int, default=5)
    a = ap.parse_args(argv)
    a0 = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.mm(a0, a0)  # torch's cuBLASLt loaded: the library the binding finds
    lib = cublaslt.library()
    torch.manual_seed(0)
    rows = []
    for n in [int(v) for v in a.n.split(",")]:
        W = [torch.randn(n, HIDDEN, device="cuda").div_(HIDDEN ** 0.5).to(torch.bfloat16) for _ in range(LAYERS)]
        for m in [int(v) for v in a.m.split(",")]:
            rows.append(measure(lib, W, n, m, a.samples))
        del W
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({**commit_info(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    print("    N     M       mm       a0     best  algo  kernel")
    for r in rows:
        al = r["algos"]
        print(f"{r['N']:5d} {r['M']:5d} {al['mm']['us']:8.2f} {al.get('a0', {}).get('us', float('nan')):8.2f} "
              f"{al[r['best']]['us']:8.2f} {r['best']:>5s}  {al[r['best']]['kernels'][:1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
