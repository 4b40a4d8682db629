#!/usr/bin/env python3
"""Every algorithm cuBLASLt's heuristic offers for y = x @ W^T at each (N, M) of the GEMM path, timed (bench/NOTES.md
"Every M"): torch.mm takes the heuristic's first answer, which steps where the bytes do not (TP4 M = 65: 27.3 us with
torch.mm, 40.4 with cuBLASLt's first algorithm, 22.0 at M = 80; `bench/results/h200-gemm-dispatch.json`). Is there an
algorithm in the list that is fast at every M? Per (N, M): the algorithms the heuristic offers with a workspace of 32,
4, 1 and 0 MiB (at most 8 each), each captured in a CUDA graph over 8 layers of distinct weights, medians, beside
torch.mm; per algorithm its kernels (torch.profiler), workspace, config id, tile, split-K and stages, and its y against
torch.mm's.

cuBLASLt is called through ctypes on the library torch loaded (the column-major form: y^T [N, M] = W [K, N]^T x^T).

  python3 bench/probes/cublaslt_algos.py OUT.json [--n 2176,4352,8704,17408] [--m 16,64,65,...] [--algos 32]
"""
from __future__ import annotations

import argparse
import ctypes as C
import json
import sys

import torch

from musekern.bench.report import commit_info
from musekern.bench.timing import Graph, time_graphs

HIDDEN, LAYERS, LOOPS, WORKSPACE = 8192, 8, 6, 32 << 20
WORKSPACE_CAPS = (WORKSPACE, 4 << 20, 1 << 20, 0)
MS = (1, 16, 17, 24, 32, 33, 48, 49, 56, 57, 64, 65, 72, 80, 88, 96, 112, 128, 192, 256)
NS = (2176, 4352, 8704, 17408)
# cublasLt.h / library_types.h / cublas_api.h constants
COMPUTE_32F, R_32F, R_16BF, OP_N, OP_T = 68, 0, 14, 0, 1
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
CFG_ID, CFG_TILE_ID, CFG_SPLITK, CFG_STAGES = 0, 1, 2, 6


class Algo(C.Structure):
    _fields_ = [("data", C.c_uint64 * 8)]


class Heuristic(C.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", C.c_size_t), ("state", C.c_int), ("wavesCount", C.c_float),
                ("reserved", C.c_int * 4)]


def _lib() -> C.CDLL:
    """The libcublasLt torch loaded (after a GEMM), by its path in this process's maps."""
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if "libcublasLt" in ln}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    lib = C.CDLL(sorted(paths)[0])
    vp = C.c_void_p
    lib.cublasLtCreate.argtypes = [C.POINTER(vp)]
    lib.cublasLtMatmulDescCreate.argtypes = [C.POINTER(vp), C.c_int, C.c_int]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, C.c_int, vp, C.c_size_t]
    lib.cublasLtMatrixLayoutCreate.argtypes = [C.POINTER(vp), C.c_int, C.c_uint64, C.c_uint64, C.c_int64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [C.POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, C.c_int, vp, C.c_size_t]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, C.c_int, C.POINTER(Heuristic),
                                                   C.POINTER(C.c_int)]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [C.POINTER(Algo), C.c_int, vp, C.c_size_t,
                                                         C.POINTER(C.c_size_t)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, C.POINTER(Algo), vp, C.c_size_t,
                                   vp]
    for f in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
              "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceSetAttribute",
              "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmulAlgoConfigGetAttribute", "cublasLtMatmul"):
        getattr(lib, f).restype = C.c_int
    return lib


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


class LtGemm:
    """y [M, N] = x [M, K] @ W [N, K]^T in bf16 with fp32 accumulation, as cuBLASLt's column-major D = A^T B."""

    def __init__(self, lib, handle, n: int, m: int):
        self.lib, self.h, self.n, self.m = lib, handle, n, m
        vp = C.c_void_p
        self.desc = vp()
        _ok(lib.cublasLtMatmulDescCreate(C.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = C.c_int32(op)
            _ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, C.byref(v), 4), "trans")
        self.a, self.b, self.d = vp(), vp(), vp()
        _ok(lib.cublasLtMatrixLayoutCreate(C.byref(self.a), R_16BF, HIDDEN, n, HIDDEN), "A")  # W: K x N, ld K
        _ok(lib.cublasLtMatrixLayoutCreate(C.byref(self.b), R_16BF, HIDDEN, m, HIDDEN), "B")  # x: K x M, ld K
        _ok(lib.cublasLtMatrixLayoutCreate(C.byref(self.d), R_16BF, n, m, n), "D")  # y^T: N x M, ld N
        self.alpha, self.beta = C.c_float(1.0), C.c_float(0.0)

    def algos(self, count: int, workspace: int = WORKSPACE) -> list[Heuristic]:
        lib, vp = self.lib, C.c_void_p
        pref = vp()
        _ok(lib.cublasLtMatmulPreferenceCreate(C.byref(pref)), "pref")
        ws = C.c_uint64(workspace)
        _ok(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, C.byref(ws), 8), "pref ws")
        res = (Heuristic * count)()
        got = C.c_int(0)
        _ok(lib.cublasLtMatmulAlgoGetHeuristic(self.h, self.desc, self.a, self.b, self.d, self.d, pref, count, res,
                                               C.byref(got)), "heuristic")
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def run(self, algo: Algo, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, ws: torch.Tensor) -> None:
        s = torch.cuda.current_stream().cuda_stream
        _ok(self.lib.cublasLtMatmul(self.h, self.desc, C.byref(self.alpha), w.data_ptr(), self.a, x.data_ptr(),
                                    self.b, C.byref(self.beta), y.data_ptr(), self.d, y.data_ptr(), self.d,
                                    C.byref(algo), ws.data_ptr(), WORKSPACE, s), "matmul")


def config(lib, algo: Algo) -> dict:
    out = {}
    for name, attr in (("id", CFG_ID), ("tile", CFG_TILE_ID), ("splitk", CFG_SPLITK), ("stages", CFG_STAGES)):
        v, w = C.c_int32(0), C.c_size_t(0)
        st = lib.cublasLtMatmulAlgoConfigGetAttribute(C.byref(algo), attr, C.byref(v), 4, C.byref(w))
        out[name] = v.value if st == 0 else None
    return out


def kernel_names(f) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def measure(lib, h, ws, W: list, n: int, m: int, count: int, samples: int) -> dict:
    """One (N, M): torch.mm and every algorithm the heuristic offers, timed side by side."""
    x = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    ref = torch.mm(x, W[0].t()).float()
    g = LtGemm(lib, h, n, m)
    hs, seen = [], set()
    for cap in WORKSPACE_CAPS:  # the heuristic returns at most 8 a call, and a smaller workspace excludes split-K
        for hr in g.algos(count, cap):
            if bytes(hr.algo) not in seen:
                seen.add(bytes(hr.algo))
                hs.append(hr)
    graphs = [Graph("mm", [lambda w=w: torch.mm(x, w.t(), out=y) for w in W], LOOPS, LAYERS)]
    info, calls = {"mm": {}}, {"mm": lambda: torch.mm(x, W[1].t(), out=y)}
    for i, hr in enumerate(hs):
        algo = Algo.from_buffer_copy(bytes(hr.algo))
        f = [lambda w=w, al=algo: g.run(al, w, x, y, ws) for w in W]
        try:
            f[0]()
            torch.cuda.synchronize()
        except RuntimeError as e:  # an algorithm the heuristic offered but the call refuses
            info[f"a{i}"] = {"error": str(e)}
            continue
        diff = float(((y.float() - ref).abs().max() / ref.abs().max()).item())
        info[f"a{i}"] = {"workspace": hr.workspaceSize, "waves": round(hr.wavesCount, 3),
                         "config": config(lib, algo), "max_rel_diff_vs_mm": diff}
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
          f" best={best} {info[best]['us']:7.2f} {info[best]['kernels'][:1]} of {len(hs)}",
          file=sys.stderr, flush=True)
    return {"N": n, "M": m, "algos": info, "best": best}


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", default=",".join(map(str, NS)))
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--algos", type=int, default=32)
    ap.add_argument("--samples", type=int, default=5)
    a = ap.parse_args(argv)
    lib = _lib()
    h = C.c_void_p()
    _ok(lib.cublasLtCreate(C.byref(h)), "create")
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    torch.manual_seed(0)
    rows = []
    for n in [int(v) for v in a.n.split(",")]:
        W = [torch.randn(n, HIDDEN, device="cuda").div_(HIDDEN ** 0.5).to(torch.bfloat16) for _ in range(LAYERS)]
        for m in [int(v) for v in a.m.split(",")]:
            rows.append(measure(lib, h, ws, W, n, m, a.algos, a.samples))
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
