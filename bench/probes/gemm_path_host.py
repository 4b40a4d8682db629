#!/usr/bin/env python3
"""Where an eager call of the GEMM path spends its host time (bench/NOTES.md "Every M: which path"): per (N, M),
50 calls queued back to back, the host time to enqueue them (`host_us`: perf_counter around the loop, no sync
inside; 50 calls stay far below the driver's launch queue) and the CUDA-event time across them (`gpu_us`: the
slower of the host's enqueue and the GPU), for the checked product call (`qkv_front_auto`) and its pieces: the
checks alone (`unsupported`), `torch.mm`, the GEMM path's tuned call (`gemm.launch_tuned`, where `tune` kept a
cuBLASLt algorithm), the fastest cuBLASLt candidate through the binding (workspace preallocated, and with the
workspace allocated per call as the product does), the epilogue's launch on values already read, and y's allocation.
The tuned choice and every candidate's measured GPU us are in each row.

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
from musekern.gemm import cublaslt  # noqa: E402
from musekern.gemm import tune as G  # noqa: E402
from musekern.ops import checks as CH  # noqa: E402
from musekern.ops import qkv_epilogue as E  # noqa: E402
from musekern.ops import qkv_front as F  # noqa: E402

# the path edges (TP8 64 | 65, TP4 65, TP1 65), a GEMM-path M where TP8 keeps a split-K algorithm, prefill (untuned)
CASES = ((2176, 1, 64), (2176, 1, 65), (2176, 1, 128), (4352, 2, 65), (17408, 8, 65), (2176, 1, 2048))


def _times(f, calls=50):
    """(event us, host enqueue us) per call, medians of 9."""
    f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, host = [], []
    for _ in range(9):
        torch.cuda.synchronize()
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


def _best_lt(n, m, dev, x, w, y):
    """(name, launch with a preallocated workspace, launch allocating it per call) of the fastest cuBLASLt candidate
    `tune` timed for (N, M), or None."""
    ch = G._CHOICES.get((n, m, dev))
    lt = {k: v for k, v in (ch.us if ch else {}).items() if k != "mm"}
    if not lt:
        return None
    name = min(lt, key=lt.get)
    mat = cublaslt.Matmul(cublaslt.library(), n, m, dev)
    cand = next(c for c in mat.candidates() if c.name == name)
    f, s = mat.launcher(cand), G._stream
    ws = torch.empty(max(cand.workspace, 1), dtype=torch.uint8, device="cuda")
    pre = lambda: f(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), s(dev))  # noqa: E731

    def alloc():
        t = torch.empty(cand.workspace, dtype=torch.uint8, device=dev) if cand.workspace else None
        f(w.data_ptr(), x.data_ptr(), y.data_ptr(), t.data_ptr() if t is not None else 0, s(dev))
    return name, pre, alloc


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    dev = torch.cuda.current_device()
    for n, nkv, m in CASES:
        p = _inputs(n, nkv, m, torch.Generator(device="cuda").manual_seed(1))
        musekern.prepare_ops(n, [m], num_kv_heads=nkv)
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        x, w = p["x"], p["weight"]
        tok = (p["positions"], p["slot_mapping"], p["cos_sin_cache"], p["key_cache"], p["value_cache"])
        tc = CH.fast_token_cache_values(m, dev, nkv, *tok, y.data_ptr(), y.data_ptr() + m * n * 2)
        key = (n, m, nkv, dev)
        args_ = dict(p)
        calls = {
            "qkv_front_auto": lambda p=p, y=y: musekern.qkv_front_auto(**p, out=y),
            "checks alone": lambda a=args_, y=y: F.unsupported(**a, out=y),
            "torch.mm": lambda x=x, w=w, y=y: torch.mm(x, w.t(), out=y),
            "y alloc": lambda x=x, m=m, n=n: x.new_empty(m, n),
        }
        path = "front" if F._fused(n, m, dev) else "gemm"
        if path == "gemm":
            E._RUNS[key]  # resolved (prepare loaded it)
            y0, ptrs = y.data_ptr(), (x.data_ptr(), w.data_ptr(), y.data_ptr())
            calls["epilogue launch_read"] = lambda key=key, y0=y0, tc=tc: E.launch_read(key, y0, tc, 1e-6)
            if (n, m, dev) in G._RUNS:
                calls["gemm.launch_tuned"] = lambda n=n, m=m, a=ptrs: G.launch_tuned(n, m, dev, *a)
            best = _best_lt(n, m, dev, x, w, y)
            if best:
                calls[f"cuBLASLt best, workspace ready ({best[0]})"] = best[1]
                calls["cuBLASLt best, workspace allocated"] = best[2]
        ch = G._CHOICES.get((n, m, dev))
        row = {"N": n, "M": m, "path": path, "chosen": ch.chosen if ch else None, "tuned_us": ch.us if ch else None}
        for name, f in calls.items():
            row[name] = dict(zip(("gpu_us", "host_us"), _times(f), strict=True))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("eager calls queued: host enqueue us / event us (the slower of host and GPU) per call")
    for r in rows:
        print(f"N={r['N']} M={r['M']} ({r['path']}, chosen {r['chosen']}):")
        for k, v in r.items():
            if isinstance(v, dict) and "host_us" in v:
                print(f"    {k:<58} {v['host_us']:7.1f} / {v['gpu_us']:7.1f}")
    write_results(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
