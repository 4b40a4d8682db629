"""cuBLASLt through ctypes: y [M, N] = x [M, K] @ W [N, K]^T into bf16 (fp32 accumulation), one chosen algorithm.

The GEMM path (M the fused front does not serve) needs cuBLAS's GEMM; `torch.mm` asks cuBLAS for the heuristic's
first algorithm, whose time steps where the bytes do not (bench/NOTES.md "Every M: the GEMM's algorithm": TP4 M = 65
27.0 us where another algorithm the same heuristic offers takes 21.4). This module asks cuBLASLt for every algorithm
it offers (`Matmul.candidates`) and launches the one `gemm/tune.py` measured fastest (`Matmul.launcher`). It opens the
libcublasLt torch already loaded (so both agree on the library), never links one of its own; no torch import here.

Column-major, as cuBLASLt sees row-major tensors: y^T [N, M] (ld N) = A^T B with A = W^T [K, N] (ld K) and
B = x^T [K, M] (ld K): transa = T, transb = N.

The FP8 GEMM path (gemm/fp8.py) is torch's `_scaled_mm`: an own call of cuBLASLt's 1x128 block-scaled form
faulted in CUDA-graph replay as torch's does (the same kernels: bench/NOTES.md "e4m3 weights"), so it was dropped.
"""
from __future__ import annotations

import ctypes as C
import functools
import glob
import os
import sys
import threading
from dataclasses import dataclass

from ..model import HIDDEN  # K: the model's hidden size

# cublasLt.h, cublas_api.h, library_types.h
COMPUTE_32F, R_32F, R_16BF, OP_N, OP_T = 68, 0, 14, 0, 1
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
CFG_ID, CFG_TILE_ID, CFG_SPLITK, CFG_STAGES = 0, 1, 2, 6
HEURISTIC_ASK = 32  # algorithms asked of the heuristic a call (cuBLASLt 13 answered at most 8 on the H200)
# The pointers the heuristic may assume aligned to (its default): `gemm.tune.mm` takes torch.mm for any other call.
ALIGNMENT = 256
# The heuristic's answer depends on the workspace it may use: with none it offers only unsplit kernels (the fastest
# at TP4 M = 16-128), with more the split-K ones (the fastest at TP8 M = 33-64). Asked once per cap, the union.
WORKSPACE_CAPS = (32 << 20, 4 << 20, 1 << 20, 0)
STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
          11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED",
          16: "LICENSE_ERROR"}


class CublasLtError(RuntimeError):
    """cuBLASLt is missing, or one of its calls failed (the message names the call and the status)."""


class Algo(C.Structure):
    """cublasLtMatmulAlgo_t: opaque, 64 bytes."""
    _fields_ = [("data", C.c_uint64 * 8)]


class Heuristic(C.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", Algo), ("workspaceSize", C.c_size_t), ("state", C.c_int), ("wavesCount", C.c_float),
                ("reserved", C.c_int * 4)]


_VP = C.c_void_p
_PROTOTYPES = {
    "cublasLtCreate": [C.POINTER(_VP)],
    "cublasLtGetVersion": None,
    "cublasLtMatmulDescCreate": [C.POINTER(_VP), C.c_int, C.c_int],
    "cublasLtMatmulDescDestroy": [_VP],
    "cublasLtMatmulDescSetAttribute": [_VP, C.c_int, _VP, C.c_size_t],
    "cublasLtMatrixLayoutCreate": [C.POINTER(_VP), C.c_int, C.c_uint64, C.c_uint64, C.c_int64],
    "cublasLtMatrixLayoutDestroy": [_VP],
    "cublasLtMatmulPreferenceCreate": [C.POINTER(_VP)],
    "cublasLtMatmulPreferenceDestroy": [_VP],
    "cublasLtMatmulPreferenceSetAttribute": [_VP, C.c_int, _VP, C.c_size_t],
    "cublasLtMatmulAlgoGetHeuristic": [_VP, _VP, _VP, _VP, _VP, _VP, _VP, C.c_int, C.POINTER(Heuristic),
                                       C.POINTER(C.c_int)],
    "cublasLtMatmulAlgoConfigGetAttribute": [C.POINTER(Algo), C.c_int, _VP, C.c_size_t, C.POINTER(C.c_size_t)],
    "cublasLtMatmul": [_VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP, C.POINTER(Algo), _VP, C.c_size_t,
                       _VP],
}


def library_paths(maps: str = "/proc/self/maps") -> list[str]:
    """Where libcublasLt may be, best first: the copy this process already mapped (torch's, after its first GEMM),
    then the NVIDIA wheels on sys.path (nvidia/cu13/lib, nvidia/cublas/lib)."""
    found = []
    try:
        with open(maps) as f:
            found += sorted({ln.split()[-1] for ln in f if "/libcublasLt.so" in ln})
    except OSError:
        pass
    for root in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cublas/lib"):
            found += sorted(glob.glob(os.path.join(root, sub, "libcublasLt.so*")), reverse=True)
    return list(dict.fromkeys(found))


class Library:
    """The library's entry points, typed, and one handle per device (made on first use, with that device current;
    a handle is thread-safe)."""

    def __init__(self, path: str):
        self.path = path
        self.dll = C.CDLL(path)
        for name, args in _PROTOTYPES.items():
            fn = getattr(self.dll, name)
            if args is not None:
                fn.argtypes = args
                fn.restype = C.c_int
        self.dll.cublasLtGetVersion.restype = C.c_size_t
        self.version = int(self.dll.cublasLtGetVersion())
        self._handles: dict = {}
        self._lock = threading.Lock()

    def handle(self, device: int) -> C.c_void_p:
        """The handle of `device` (created the first time with `device` current: the caller sets it)."""
        h = self._handles.get(device)
        if h is None:
            with self._lock:
                h = self._handles.get(device)
                if h is None:
                    h = _VP()
                    self.check(self.dll.cublasLtCreate(C.byref(h)), "cublasLtCreate")
                    self._handles[device] = h
        return h

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise CublasLtError(f"{what} failed: CUBLAS_STATUS_{STATUS.get(status, status)}")


@functools.lru_cache(maxsize=None)
def library() -> Library:
    """The process's cuBLASLt (load after torch ran a GEMM, so this is torch's copy); CublasLtError without one."""
    tried = library_paths()
    for p in tried:
        try:
            return Library(p)
        except (OSError, AttributeError):  # not loadable, or a library without an entry point this binding uses
            continue
    raise CublasLtError("no libcublasLt found (looked in this process's mapped libraries and the nvidia wheels on "
                        "sys.path): install torch with its CUDA wheels (`pip install torch`)")


@dataclass(frozen=True)
class Candidate:
    """One algorithm the heuristic offers: its opaque bytes, the workspace it needs, and its config (for records)."""
    algo: bytes
    workspace: int
    tile: int
    splitk: int

    @property
    def name(self) -> str:
        return f"lt[tile={self.tile},splitk={self.splitk},ws={self.workspace}]"


class Matmul:
    """The descriptors of one (N, M) on one device: y [M, N] = x [M, 8192] @ W [N, 8192]^T, bf16 operands and out,
    fp32 accumulate."""

    def __init__(self, lib: Library, n: int, m: int, device: int):
        self.lib, self.n, self.m = lib, n, m
        self.desc, self.a, self.b, self.d = _VP(), _VP(), _VP(), _VP()  # set first: __del__ frees what was made
        self.h = lib.handle(device)
        d, ok = lib.dll, lib.check
        ok(d.cublasLtMatmulDescCreate(C.byref(self.desc), COMPUTE_32F, R_32F), "cublasLtMatmulDescCreate")
        for attr, val in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = C.c_int32(val)
            ok(d.cublasLtMatmulDescSetAttribute(self.desc, attr, C.byref(v), 4), "cublasLtMatmulDescSetAttribute")
        for lay, rows, cols, ld in ((self.a, HIDDEN, n, HIDDEN), (self.b, HIDDEN, m, HIDDEN), (self.d, n, m, n)):
            ok(d.cublasLtMatrixLayoutCreate(C.byref(lay), R_16BF, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        self._alpha, self._beta = C.c_float(1.0), C.c_float(0.0)
        self._args = (self.h, self.desc, C.byref(self._alpha))  # the call's fixed leading arguments
        self._fn = d.cublasLtMatmul

    def __del__(self):
        d = getattr(getattr(self, "lib", None), "dll", None)
        if d is None:
            return
        for lay in (getattr(self, k, None) for k in ("a", "b", "d")):
            if lay:
                d.cublasLtMatrixLayoutDestroy(lay)
        if getattr(self, "desc", None):
            d.cublasLtMatmulDescDestroy(self.desc)

    def candidates(self, caps=WORKSPACE_CAPS) -> list[Candidate]:
        """Every algorithm the heuristic offers under each workspace cap, in its order, each once."""
        d, ok = self.lib.dll, self.lib.check
        out, seen = [], set()
        for cap in caps:
            pref = _VP()
            ok(d.cublasLtMatmulPreferenceCreate(C.byref(pref)), "cublasLtMatmulPreferenceCreate")
            try:
                ws = C.c_uint64(cap)
                ok(d.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, C.byref(ws), 8),
                   "cublasLtMatmulPreferenceSetAttribute")
                res, got = (Heuristic * HEURISTIC_ASK)(), C.c_int(0)
                st = d.cublasLtMatmulAlgoGetHeuristic(self.h, self.desc, self.a, self.b, self.d, self.d,
                                                      pref, HEURISTIC_ASK, res, C.byref(got))
            finally:
                d.cublasLtMatmulPreferenceDestroy(pref)
            if st == 15:  # NOT_SUPPORTED: no algorithm under this cap
                continue
            ok(st, "cublasLtMatmulAlgoGetHeuristic")
            for h in res[:got.value]:
                key = bytes(h.algo)
                if h.state == 0 and key not in seen:
                    seen.add(key)
                    out.append(Candidate(key, int(h.workspaceSize), self._config(h.algo, CFG_TILE_ID),
                                         self._config(h.algo, CFG_SPLITK)))
        return out

    def _config(self, algo: Algo, attr: int) -> int:
        v, w = C.c_int32(0), C.c_size_t(0)
        st = self.lib.dll.cublasLtMatmulAlgoConfigGetAttribute(C.byref(algo), attr, C.byref(v), 4, C.byref(w))
        return v.value if st == 0 else -1

    def launcher(self, cand: Candidate):
        """f(w_ptr, x_ptr, y_ptr, workspace_ptr, stream) -> None: this algorithm, checked status. The function keeps
        this Matmul (its descriptors) and the algorithm alive as long as it lives. Pointers must be ALIGNMENT-byte
        aligned and the workspace `cand.workspace` bytes."""
        algo = Algo.from_buffer_copy(cand.algo)
        pa, ws, fn, (h, desc, alpha) = C.byref(algo), cand.workspace, self._fn, self._args
        a, b, d, beta, check, mat = self.a, self.b, self.d, C.byref(self._beta), self.lib.check, self

        def run(w: int, x: int, y: int, workspace: int, stream: int) -> None:
            st = fn(h, desc, alpha, w, a, x, b, beta, y, d, y, d, pa, workspace, ws, stream)
            if st:
                check(st, f"cublasLtMatmul ({mat.n} x {mat.m})")

        return run
