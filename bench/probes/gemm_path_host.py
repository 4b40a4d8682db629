#!/usr/bin/env python3
"""Where an eager call of the GEMM path spends its host time (bench/NOTES.md "Every M: which path"): per (N, M),
50 calls queued back to back, the host time to enqueue them (`host_us`) and the CUDA-event time across them
(`gpu_us`: the slower of the host's enqueue and the GPU, not the GPU's busy time), for the
checked product call (`qkv_front_auto`), `torch.mm` alone, `torch.mm` + the epilogue's bound launcher (with and
without PDL), the launcher alone, and the product call at M = 64 (the fused front) for reference.

  python3 bench/probes/gemm_path_host.py [--out FILE]        (on the GPU machine, the carried cache)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from issue13_table import _inputs, write_results  # noqa: E402

import musekern  # noqa: E402
from musekern.ops import qkv_epilogue as E  # noqa: E402
from musekern.ops import qkv_front as F  # noqa: E402

CASES = ((2176, 1, 64), (2176, 1, 65), (4352, 2, 65), (2176, 1, 2048))


def _times(f, calls=50):
    """(event us, host enqueue us) per call, medians of 7."""
    f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, host = [], []
    for _ in range(7):
        a.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) * 1e3 / calls)
        host.append((t1 - t0) * 1e6 / calls)
    return round(statistics.median(gpu), 2), round(statistics.median(host), 2)


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    for n, nkv, m in CASES:
        p = _inputs(n, nkv, m, torch.Generator(device="cuda").manual_seed(1))
        musekern.prepare_ops(n, [m], num_kv_heads=nkv)
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        tok = (p["positions"], p["cos_sin_cache"], p["slot_mapping"], p["key_cache"], p["value_cache"])
        v = E.epilogue_variant(n, m, nkv)
        kernel = E._loaded(v, torch.cuda.current_device())[0]
        values = [E.launch_args(y, *tok, nkv, 1e-6)[name] for name in kernel.param_names]
        grid = E.launch_grid(v, m, n, nkv)
        pdl, nopdl = kernel.launcher(grid), kernel.launcher(grid, pdl=False)
        x, w = p["x"], p["weight"]
        calls = {
            "qkv_front_auto": lambda p=p, y=y: musekern.qkv_front_auto(**p, out=y),
            "torch.mm": lambda x=x, w=w, y=y: torch.mm(x, w.t(), out=y),
            "torch.mm + epilogue launcher (PDL)": lambda x=x, w=w, y=y, f=pdl, a=values: (torch.mm(x, w.t(), out=y),
                                                                                         f(a)),
            "torch.mm + epilogue launcher (no PDL)": lambda x=x, w=w, y=y, f=nopdl, a=values: (
                torch.mm(x, w.t(), out=y), f(a)),
            "epilogue launcher alone": lambda f=pdl, a=values: f(a),
        }
        row = {"N": n, "M": m, "path": "front" if F._fused(n, m, torch.cuda.current_device()) else "gemm"}
        for name, f in calls.items():
            row[name] = dict(zip(("gpu_us", "host_us"), _times(f), strict=True))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    print("eager calls queued: host enqueue us / event us (the slower of host and GPU) per call")
    for r in rows:
        print(f"N={r['N']} M={r['M']} ({r['path']}): " + " | ".join(
            f"{k} {r[k]['host_us']:.1f} / {r[k]['gpu_us']:.1f}" for k in names))
    write_results(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
