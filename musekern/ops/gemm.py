"""The GEMM path's y = x @ W^T: cuBLAS's algorithm measured fastest for this (N, M) on this GPU, else torch.mm.

`torch.mm` takes the first algorithm of cuBLAS's heuristic, and that choice steps where the bytes do not (TP4
25.7 -> 26.9 us from M = 64 to 65 while other algorithms the heuristic offers take 21.0 -> 21.4; bench/NOTES.md
"Every M: the GEMM's algorithm"). cuBLAS's algorithms and their speeds change with its version and the GPU, so no
rule can name one ahead of time: `tune` (run by `ops.qkv_front.prepare`, before graph capture) checks every algorithm
cuBLASLt offers for the shape against torch.mm's result, times them and torch.mm on scratch buffers (weights rotated
past the L2, as a decode step streams them), and keeps the fastest. `mm` then launches it: one dict lookup and one
cuBLASLt call (no sync, no allocation but the algorithm's workspace from torch's stream-ordered allocator,
capturable). A shape never tuned, a process without cuBLASLt, or a call whose pointers are not 256-byte aligned takes
torch.mm. A tuned shape's result is bit-identical call to call (tests/test_gpu_gemm.py); another process may measure
another algorithm fastest, so its bits may differ in the last place.
"""
from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass

import torch

from ..runtime.cublaslt import ALIGNMENT
from ..runtime.loader import current_stream_getter
from ..variants.qkv_front import HIDDEN

# An algorithm replaces torch.mm only when it is more than this much faster: the H200's spread between samples of one
# graph reaches 3-4% at TP1 (68 / 72 us modes, bench/results/h200-bench.json), where a 1% margin kept a cuBLASLt
# pick the bench then timed 3% slower than torch.mm (M = 48). The picks that matter win by 4-30%.
MARGIN = 0.03
ROUNDS, CALLS = 5, 8  # timing: median over ROUNDS of CALLS launches each, weights rotated
# Above this M the GEMM is bound by its math (at M = 1024 and 4096 cuBLASLt's first algorithm took torch.mm's time
# within 1-2%, bench/results/h200-gemm-dispatch.json; the other candidates were not timed there), and timing every
# candidate would cost seconds a shape.
TUNE_MAX_ROWS = 512
# A candidate whose y differs from torch.mm's by more than this (relative to max |y|) is wrong, not rounded otherwise
# (another summation order differs by about one bf16 ulp, 2^-8: bench/results/h200-gemm-dispatch.json, 3.5e-3)
CHECK_RTOL = 2.0 ** -5


@dataclass(frozen=True)
class Choice:
    """What `tune` measured for one (N, M, device): every candidate's us a call, and the one kept."""
    n: int
    m: int
    device: int
    us: dict  # candidate name -> median us per call ("mm" is torch.mm)
    chosen: str  # "mm" or a cuBLASLt candidate's name
    reason: str = ""  # why only torch.mm was timed (no cuBLASLt, M too large, no memory), else ""
    rejected: tuple = ()  # candidates whose result or launch failed the check, with why


_RUNS: dict = {}  # (n, m, device) -> (launch(w, x, y, workspace, stream), workspace bytes)
_CHOICES: dict = {}  # (n, m, device) -> Choice
_LOCK = threading.Lock()
_stream = current_stream_getter()  # device index -> torch's current stream there, as a raw handle


def choices() -> list[Choice]:
    """Every shape tuned in this process (for the bench's records)."""
    return list(_CHOICES.values())


def mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ weight^T (contiguous bf16 [M, 8192], [N, 8192], [M, N] on one device): the tuned algorithm, or
    torch.mm for a shape `tune` has not measured (or where torch.mm was fastest, or pointers not 256-byte aligned)."""
    if not launch_tuned(weight.shape[0], x.shape[0], x.get_device(), x.data_ptr(), weight.data_ptr(),
                        out.data_ptr()):
        torch.mm(x, weight.t(), out=out)
    return out


def launch_tuned(n: int, m: int, dev: int, x0: int, w0: int, y0: int) -> bool:
    """`mm` on values already read (the checked call's): the tuned algorithm on the addresses of x, weight and y,
    True; False (nothing launched) where torch.mm must run."""
    run = _RUNS.get((n, m, dev))
    if run is None or (x0 | w0 | y0) % ALIGNMENT:
        return False
    launch, ws = run
    if dev != torch.cuda.current_device():  # the handle and stream are x's device's: launch there
        with torch.cuda.device(dev):
            return launch_tuned(n, m, dev, x0, w0, y0)
    workspace = torch.empty(ws, dtype=torch.uint8, device=dev) if ws else None  # stream-ordered, as torch's
    launch(w0, x0, y0, workspace.data_ptr() if ws else 0, _stream(dev))
    return True


def tune(n: int, ms, device: int) -> list[Choice]:
    """Check and time, for each M in `ms`, torch.mm and every algorithm cuBLASLt offers, and keep the fastest for
    `mm`. Syncs the device and allocates scratch while it runs (weights of at least two layers, about twice the L2 at
    TP8: 107 MB, 570 MB at TP1; no memory for them leaves torch.mm, with the reason): call it before capture, never
    inside. 0.1-0.5 s an M. Shapes already tuned are kept."""
    ms = list(ms)
    with _LOCK, torch.cuda.device(device):
        dev = torch.device("cuda", device)
        a = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device=dev)
        torch.mm(a, a.t())  # torch's cuBLAS handle for this thread and stream, and its cuBLASLt loaded and found below
        todo = [m for m in sorted(set(ms)) if (n, m, device) not in _CHOICES]
        if todo:
            _tune(n, todo, device, dev)
    return [_CHOICES[(n, m, device)] for m in ms]


def _tune(n: int, todo: list, device: int, dev: torch.device) -> None:
    from ..runtime import cublaslt

    try:
        lib, reason = cublaslt.library(), ""
    except cublaslt.CublasLtError as e:
        lib, reason = None, f"no cuBLASLt: {e}"
    timed = [m for m in todo if lib is not None and m <= TUNE_MAX_ROWS]
    for m in todo:
        if m not in timed:  # torch.mm, untimed
            _CHOICES[(n, m, device)] = Choice(n, m, device, {}, "mm", reason or f"M > {TUNE_MAX_ROWS}: torch.mm")
    if not timed:
        return
    W = []
    try:
        layers = max(2, -(-2 * torch.cuda.get_device_properties(device).L2_cache_size // (n * HIDDEN * 2)))
        for _ in range(layers):
            W.append(torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev).normal_().div_(HIDDEN ** 0.5))
        for m in timed:
            _CHOICES[(n, m, device)] = _tune_one(cublaslt.Matmul(lib, n, m, device), W, n, m, device)
    except torch.cuda.OutOfMemoryError as e:
        for m in timed:
            _CHOICES.setdefault((n, m, device), Choice(n, m, device, {}, "mm", f"no memory to tune: {e}"[:200]))
    finally:
        del W
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _tune_one(mat, W: list, n: int, m: int, device: int) -> Choice:
    dev = W[0].device
    x = torch.randn(m, HIDDEN, device=dev).to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    want = torch.mm(x, W[0].t()).float()
    tol = CHECK_RTOL * want.abs().max().item()
    runs, rejected = {"mm": (lambda w: torch.mm(x, w.t(), out=y), None)}, []
    cands = mat.candidates()
    ws = torch.empty(max([c.workspace for c in cands] + [1]), dtype=torch.uint8, device=dev)
    for c in cands:
        f = mat.launcher(c)
        call = (lambda w, f=f: f(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), _stream(device)))
        try:  # its result first: an algorithm that returns success must also return the product
            y.fill_(float("nan"))
            call(W[0])
            torch.cuda.synchronize(device)
        except RuntimeError as e:  # the launch refused (CublasLtError): not a candidate
            rejected.append((c.name, str(e)))
            continue
        err = (y.float() - want).abs().max().item()
        if not err <= tol:  # NaN (an unwritten y) fails too
            rejected.append((c.name, f"max |y - torch.mm| = {err:.3g} > {tol:.3g}"))
            continue
        runs[c.name] = (call, (f, c.workspace))
    us = {}
    for name, (call, _) in runs.items():
        try:
            us[name] = _time(call, W)
        except RuntimeError as e:  # a launch the capture refused
            rejected.append((name, str(e)))
    best = pick(us)
    if best != "mm":
        _RUNS[(n, m, device)] = runs[best][1]  # the launcher keeps its Matmul's descriptors alive
    return Choice(n, m, device, {k: round(v, 3) for k, v in us.items()}, best, rejected=tuple(rejected))


def pick(us: dict) -> str:
    """The candidate to keep from measured us a call: the fastest, if it beats torch.mm ("mm") by more than MARGIN
    (or torch.mm was not timed), else torch.mm."""
    best = min(us, key=us.get)
    if best != "mm" and "mm" in us and us[best] > us["mm"] * (1 - MARGIN):
        return "mm"
    return best


def _time(call, W: list) -> float:
    """Median us a call: CALLS calls (weights rotated, so they stream from HBM as a decode step's do) captured in a
    CUDA graph, replayed ROUNDS times between events (no host launch cost in the time)."""
    call(W[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            call(W[i % len(W)])
    g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(ROUNDS):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / CALLS)
    return statistics.median(ts)
