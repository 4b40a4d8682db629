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

What `tune` measured is kept in the kernel cache, per GPU model and cuBLASLt version (gemm/records.py): a later
process on such a GPU takes the recorded pick after checking it (cuBLASLt still offers that algorithm for the shape,
and its result matches torch.mm's) instead of timing every candidate again. A record can change which correct
algorithm runs, never the result; `musekern clean --all` removes the records.
"""
from __future__ import annotations

import logging
import statistics
import threading
from dataclasses import dataclass

import torch

from ..model import HIDDEN
from ..runtime.loader import current_stream_getter, open_cache
from . import records
from .cublaslt import ALIGNMENT

log = logging.getLogger("musekern.gemm")
log.addHandler(logging.NullHandler())

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
    recorded: bool = False  # taken from the cache's tuning record (checked, not timed) in this process


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
    inside. 0.06-0.5 s an M timed. Shapes already tuned in this process are kept; shapes the cache's tuning record
    holds for this GPU and cuBLASLt are checked, not timed (one launch each; bench/results/h200-prepare-time.json),
    and what is timed is added to the record."""
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
    from . import cublaslt

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
    cache, scope = _record_scope(lib, device)
    recorded = records.load(cache, scope) if cache is not None else {}
    W, fresh = [], {}
    try:
        layers = max(2, -(-2 * torch.cuda.get_device_properties(device).L2_cache_size // (n * HIDDEN * 2)))
        for m in timed:
            mat = cublaslt.Matmul(lib, n, m, device)
            rec, choice = recorded.get((n, m)), None
            if rec is not None:
                if rec.chosen != "mm" and not W:  # the check's weight: a recorded algorithm is checked too
                    W.append(_scratch_weight(n, dev))
                choice = _from_record(mat, rec, W[0] if W else None, n, m, device)
            if choice is None:
                while len(W) < layers:
                    W.append(_scratch_weight(n, dev))
                choice, cand = _tune_one(mat, W, n, m, device)
                fresh[(n, m)] = records.Record(choice.chosen, cand.algo if cand else None,
                                              cand.workspace if cand else 0, choice.us)
            _CHOICES[(n, m, device)] = choice
    except torch.cuda.OutOfMemoryError as e:
        for m in timed:
            _CHOICES.setdefault((n, m, device), Choice(n, m, device, {}, "mm", f"no memory to tune: {e}"[:200]))
    finally:
        del W
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    if fresh and cache is not None:
        why = records.save(cache, scope, fresh)
        if why:
            log.warning("%s", why)


def _scratch_weight(n: int, dev: torch.device) -> torch.Tensor:
    return torch.empty(n, HIDDEN, dtype=torch.bfloat16, device=dev).normal_().div_(HIDDEN ** 0.5)


def _record_scope(lib, device: int):
    """(the cache the kernels load from, or None where there is none to name, the tuning scope of this GPU and
    cuBLASLt)."""
    p = torch.cuda.get_device_properties(device)
    scope = records.scope(p.name, (p.major, p.minor), p.multi_processor_count, lib.version)
    try:
        return open_cache(), scope
    except (ImportError, OSError, ValueError) as e:  # no cache dir to name (platformdirs missing, a bad path)
        log.warning("GEMM tuning not recorded: %s", e)
        return None, scope


def _probe(W0: torch.Tensor, m: int):
    """(x, y, torch.mm's y in fp32, the tolerance) for checking a candidate's result on weight W0."""
    x = torch.randn(m, HIDDEN, device=W0.device).to(torch.bfloat16)
    y = torch.empty(m, W0.shape[0], dtype=torch.bfloat16, device=W0.device)
    want = torch.mm(x, W0.t()).float()
    return x, y, want, CHECK_RTOL * want.abs().max().item()


def _check(call, W0, y, want, tol: float, device: int) -> str | None:
    """Launch `call(W0)` into y (poisoned first): None when its result is torch.mm's within `tol`, else why not."""
    try:  # an algorithm that returns success must also return the product
        y.fill_(float("nan"))
        call(W0)
        torch.cuda.synchronize(device)
    except RuntimeError as e:  # the launch refused (CublasLtError)
        return str(e)
    err = (y.float() - want).abs().max().item()
    return None if err <= tol else f"max |y - torch.mm| = {err:.3g} > {tol:.3g}"  # NaN (unwritten y) fails too


def _from_record(mat, rec: records.Record, W0: torch.Tensor | None, n: int, m: int, device: int) -> Choice | None:
    """The recorded pick for (N, M), re-decided from its times by `pick` and checked (cuBLASLt offers exactly those
    algorithm bytes for this shape now, and their result is torch.mm's), or None: then the shape is timed again."""
    best = pick(rec.us)
    if best != rec.chosen:  # recorded under another rule (MARGIN)
        return None
    if best == "mm":
        return Choice(n, m, device, dict(rec.us), "mm", recorded=True)
    cand = next((c for c in mat.candidates()
                 if c.algo == rec.algo and c.workspace == rec.workspace and c.name == best), None)
    if cand is None:
        return None
    x, y, want, tol = _probe(W0, m)
    f = mat.launcher(cand)
    ws = torch.empty(max(cand.workspace, 1), dtype=torch.uint8, device=W0.device)
    call = (lambda w: f(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), _stream(device)))
    if _check(call, W0, y, want, tol, device) is not None:
        return None
    _RUNS[(n, m, device)] = (f, cand.workspace)
    return Choice(n, m, device, dict(rec.us), best, recorded=True)


def _tune_one(mat, W: list, n: int, m: int, device: int):
    """(Choice, the chosen Candidate or None for torch.mm): every candidate checked, then timed."""
    x, y, want, tol = _probe(W[0], m)
    runs, rejected = {"mm": (lambda w: torch.mm(x, w.t(), out=y), None)}, []
    cands = mat.candidates()
    ws = torch.empty(max([c.workspace for c in cands] + [1]), dtype=torch.uint8, device=W[0].device)
    for c in cands:
        f = mat.launcher(c)
        call = (lambda w, f=f: f(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), _stream(device)))
        why = _check(call, W[0], y, want, tol, device)
        if why is not None:
            rejected.append((c.name, why))
            continue
        runs[c.name] = (call, (f, c.workspace), c)
    us = {}
    for name, (call, *_) in runs.items():
        try:
            us[name] = round(_time(call, W), 3)  # as the record keeps it: the pick re-decided from it is this one
        except RuntimeError as e:  # a launch the capture refused
            rejected.append((name, str(e)))
    best = pick(us)
    cand = None
    if best != "mm":
        _RUNS[(n, m, device)] = runs[best][1]  # the launcher keeps its Matmul's descriptors alive
        cand = runs[best][2]
    return Choice(n, m, device, us, best, rejected=tuple(rejected)), cand


def pick(us: dict) -> str:
    """The candidate to keep from measured us a call: the fastest (of equal times the first name in sorted order, so
    the pick does not depend on the dict's order), if it beats torch.mm ("mm") by more than MARGIN (or torch.mm was
    not timed), else torch.mm."""
    best = min(sorted(us), key=us.get)
    if best != "mm" and "mm" in us and us[best] > us["mm"] * (1 - MARGIN):
        return "mm"
    return best


def _time(call, W: list, rounds: int = ROUNDS) -> float:
    """Median us a call: CALLS calls (weights rotated, so they stream from HBM as a decode step's do) captured in a
    CUDA graph, replayed `rounds` times between events (no host launch cost in the time)."""
    call(W[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            call(W[i % len(W)])
    g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(rounds):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / CALLS)
    return statistics.median(ts)
