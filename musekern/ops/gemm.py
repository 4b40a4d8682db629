"""The GEMM path's y = x @ W^T: cuBLAS's algorithm measured fastest for this (N, M) on this GPU, else torch.mm.

`torch.mm` takes the first algorithm of cuBLAS's heuristic, and that choice steps where the bytes do not (TP4
25.7 -> 26.9 us from M = 64 to 65 while other algorithms the heuristic offers take 21.0 -> 21.4; bench/NOTES.md
"Every M: the GEMM's algorithm"). cuBLAS's algorithms and their speeds change with its version and the GPU, so no
rule can name one ahead of time: `tune` (run by `ops.qkv_front.prepare`, before graph capture) times torch.mm and
every algorithm cuBLASLt offers for the shape on scratch buffers (weights rotated past the L2, as a decode step
streams them), and keeps the fastest. `mm` then launches it: one dict lookup and one cuBLASLt call (no sync, no
allocation but the algorithm's workspace from torch's stream-ordered allocator, capturable). A shape never tuned, or
a process without cuBLASLt, takes torch.mm. A tuned shape's result is bit-identical call to call (one algorithm, no
atomics); a different process may measure another algorithm fastest, so its bits may differ in the last place.
"""
from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass

import torch

from ..runtime.loader import current_stream_getter

HIDDEN = 8192
# An algorithm replaces torch.mm only when it is more than this much faster: the H200's spread between samples of one
# graph reaches 3-4% at TP1 (68 / 72 us modes, bench/results/h200-bench.json), where a 1% margin kept a cuBLASLt
# pick the bench then timed 3% slower than torch.mm (M = 48). The picks that matter win by 4-30%.
MARGIN = 0.03
ROUNDS, CALLS = 5, 8  # timing: median over ROUNDS of CALLS launches each, weights rotated
# Above this M the GEMM is bound by its math (at M = 1024 and 4096 cuBLASLt's first algorithm took torch.mm's time
# within 1-2%, bench/results/h200-gemm-dispatch.json; the other candidates were not timed there), and timing every
# candidate would cost seconds a shape.
TUNE_MAX_ROWS = 512


@dataclass(frozen=True)
class Choice:
    """What `tune` measured for one (N, M, device): every candidate's us a call, and the one kept."""
    n: int
    m: int
    device: int
    us: dict  # candidate name -> median us per call ("mm" is torch.mm)
    chosen: str  # "mm" or a cuBLASLt candidate's name
    reason: str = ""  # why only torch.mm was timed (no cuBLASLt), else ""


_RUNS: dict = {}  # (n, m, device) -> (launch(w, x, y, workspace, stream), workspace bytes)
_CHOICES: dict = {}  # (n, m, device) -> Choice
_KEEP: dict = {}  # (n, m, device) -> the cuBLASLt descriptors its launch uses
_LOCK = threading.Lock()
_stream = current_stream_getter()  # device index -> torch's current stream there, as a raw handle


def choices() -> list[Choice]:
    """Every shape tuned in this process (for `musekern doctor`, the bench's records)."""
    return list(_CHOICES.values())


def mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ weight^T (contiguous bf16 [M, 8192], [N, 8192], [M, N] on one device): the tuned algorithm, or
    torch.mm for a shape `tune` has not measured (or where torch.mm was fastest)."""
    m, n = x.shape[0], weight.shape[0]
    run = _RUNS.get((n, m, x.get_device()))
    if run is None:
        return torch.mm(x, weight.t(), out=out)
    launch, ws = run
    workspace = torch.empty(ws, dtype=torch.uint8, device=x.device) if ws else None  # stream-ordered, as torch's
    launch(weight.data_ptr(), x.data_ptr(), out.data_ptr(), workspace.data_ptr() if ws else 0,
           _stream(x.get_device()))
    return out


def tune(n: int, ms, device: int) -> list[Choice]:
    """Measure, for each M in `ms`, torch.mm and every algorithm cuBLASLt offers, and keep the fastest for `mm`.
    Syncs the device and allocates scratch (the weights: about 2x the L2 or two layers, whichever is more): call
    it before capture, never inside. Shapes already tuned are kept."""
    todo = [m for m in sorted(set(ms)) if (n, m, device) not in _CHOICES]
    if not todo:
        return [_CHOICES[(n, m, device)] for m in ms]
    with _LOCK, torch.cuda.device(device):
        dev = torch.device("cuda", device)
        a = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device=dev)
        torch.mm(a, a.t())  # torch's cuBLAS(Lt) loaded and its handle made: the library found is torch's
        from ..runtime import cublaslt

        try:
            lib, reason = cublaslt.library(), ""
        except (cublaslt.CublasLtError, OSError) as e:
            lib, reason = None, f"no cuBLASLt: {e}"
        timed = [m for m in todo if lib is not None and m <= TUNE_MAX_ROWS]
        for m in todo:
            if m not in timed:  # torch.mm, untimed
                _CHOICES[(n, m, device)] = Choice(n, m, device, {}, "mm",
                                                  reason or f"M > {TUNE_MAX_ROWS}: torch.mm untimed")
        if timed:
            layers = max(2, -(-2 * torch.cuda.get_device_properties(device).L2_cache_size // (n * HIDDEN * 2)))
            W = [torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
            for w in W:
                w.normal_().div_(HIDDEN ** 0.5)
            for m in timed:
                _CHOICES[(n, m, device)] = _tune_one(cublaslt.Matmul(lib, n, m, device), W, n, m, device)
            del W
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    return [_CHOICES[(n, m, device)] for m in ms]


def _tune_one(mat, W: list, n: int, m: int, device: int) -> Choice:
    dev = W[0].device
    x = torch.randn(m, HIDDEN, device=dev).to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    runs = {"mm": (lambda w: torch.mm(x, w.t(), out=y), None)}
    cands = mat.candidates()
    ws = torch.empty(max([c.workspace for c in cands] + [1]), dtype=torch.uint8, device=dev)
    for c in cands:
        f = mat.launcher(c)
        runs[c.name] = (lambda w, f=f: f(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), _stream(device)),
                        (f, c.workspace, mat))
    us = {}
    for name, (call, _) in runs.items():
        try:
            us[name] = _time(call, W)
        except RuntimeError:  # an algorithm the heuristic offered but the launch refused: not a candidate
            continue
    best = pick(us)
    if best != "mm":
        _RUNS[(n, m, device)] = runs[best][1][:2]
        _KEEP[(n, m, device)] = runs[best][1][2]  # the descriptors the launch uses
    return Choice(n, m, device, {k: round(v, 3) for k, v in us.items()}, best)


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
    call(W[0])  # raises here, outside the capture, for an algorithm the launch refuses
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
