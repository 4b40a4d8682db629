"""`musekern bench`: your model's planned qkv_front and qk_norm timed on your GPU against cuBLAS (torch.mm).

Each (TP rank, M) is timed as a decode step runs it: the calls of several layers, each with its own weights (as many
as it takes to stream at least twice the GPU's L2, so the weights come from HBM), captured in a CUDA graph that is
replayed between CUDA events; the median of the samples, per call. qkv_front (the fused front, or cuBLAS's GEMM + the
fused epilogue where the planner sends that M) runs against `torch.mm(x, W^T)` alone, the GEMM it replaces without
its epilogue; qk_norm on the q | k heads of the projection output (rows strided) against the same norm in torch ops.
Before timing, qkv_front's v | gate columns, which it stores unchanged, are checked against torch.mm's.

Table (or --json) on stdout, progress on stderr. The research harness (every mode, the roofline, the all-M table,
host costs) lives outside the package, in the repository's bench/harness/.
"""
from __future__ import annotations

import math
import os
import statistics

import click

from ..env import CACHE_DIR
from .common import Failure, cache_dir_option, emit_json, json_option, load_model, log, model_option, table, tp_option

DEFAULT_MS = (1, 8, 16, 64, 256)  # decode sizes the fused front serves, and two the GEMM path takes
ROTATE_L2 = 2  # the rotated weights (inputs for qk_norm) stream at least this many times the L2 per pass
GRAPH_US = 2000.0  # GPU time a replay aims at, so the events' own cost stays far below 1%
CHECK_RTOL = 2.0 ** -5  # v | gate vs torch.mm, relative to max |y|: another summation order differs by ~2^-8
HEADERS = ["op", "tp", "N", "M", "path", "musekern us", "baseline", "baseline us", "speedup", "GB/s", "check"]


def gpu_problem() -> str | None:
    """Why this process cannot time on a GPU (one line), or None."""
    try:
        import torch
    except ImportError:
        return "musekern bench needs torch: `pip install 'musekern[torch]'` (or run it in your engine's environment)"
    if not torch.cuda.is_available():
        return ("musekern bench needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False): run it "
                "on the machine that serves the model")
    return None


def copies(nbytes: int, l2_bytes: int, most: int = 64) -> int:
    """How many buffers of `nbytes` a graph rotates over so that one pass streams ROTATE_L2 x the L2 (at least 2)."""
    return max(2, min(most, math.ceil(ROTATE_L2 * l2_bytes / max(nbytes, 1))))


def passes(pass_us: float) -> int:
    """How many passes over the rotated calls one graph holds, from one pass's time, to fill GRAPH_US."""
    return max(1, min(1000, math.ceil(GRAPH_US / max(pass_us, 1e-3))))


def time_calls(calls: list, samples: int) -> float:
    """Median us per call: the calls captured in a CUDA graph (`passes` times over), replayed between events."""
    import torch

    def graph(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                for c in calls:
                    c()
        return g

    def replay_us(g):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()  # the GPU busy when the first event is recorded: no host gap timed
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) * 1e3

    side = torch.cuda.Stream()  # warm-up outside capture, as torch asks: kernels loaded, cuBLAS's handles made
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    n = passes(replay_us(graph(1)))
    g = graph(n)
    return statistics.median(replay_us(g) for _ in range(samples)) / (n * len(calls))


def row(op, shard, m, path, us, base, base_us, nbytes, check) -> dict:
    return {"op": op, "tp": shard.tp, "N": shard.n, "M": m, "path": path, "musekern_us": round(us, 3),
            "baseline": base, "baseline_us": round(base_us, 3), "speedup": round(base_us / us, 3),
            "gbps": round(nbytes / us / 1e3, 1), "check": check}


def bench_front(shard, m: int, eps: float, l2: int, samples: int, target) -> dict:
    """qkv_front at (N, M) against torch.mm over the same rotated weights."""
    import torch

    from ..kernels.qkv_front.rules import front_serves
    from ..model import HIDDEN
    from ..ops import qkv_front as front

    n, nkv, dev, bf = shard.n, shard.num_kv_heads, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    layers = copies(n * HIDDEN * 2, l2)
    W = [torch.empty(n, HIDDEN, dtype=bf, device=dev).normal_().div_(HIDDEN ** 0.5) for _ in range(layers)]
    x = torch.randn(m, HIDDEN, device=dev).to(bf)
    blocks, block_size, max_pos = max(64, -(-m // 16) + 1), 16, 4096
    kc, vc = torch.randn(2, blocks, block_size, nkv, shard.head_dim, device=dev).to(bf)  # vLLM's split layout
    pos = torch.randint(0, max_pos, (m,), device=dev)
    cos_sin = torch.randn(max_pos, shard.head_dim, device=dev)
    slots = torch.randperm(blocks * block_size, device=dev)[:m]
    ys = [torch.empty(m, n, dtype=bf, device=dev) for _ in W]
    front.prepare(n, rows=[m], num_kv_heads=nkv, device=dev.index)  # loaded, and the GEMM tuned, before capture
    y = front.qkv_front(x, W[0], pos, cos_sin, slots, kc, vc, nkv, eps, out=ys[0])  # checked, eager
    want = torch.mm(x, W[0].t())
    c0 = (shard.num_q_heads + nkv) * shard.head_dim  # v | gate: stored as the GEMM made them
    err = (y[:, c0:].float() - want[:, c0:].float()).abs().max().item()
    check = "ok" if err <= CHECK_RTOL * want.abs().max().item() else f"v|gate off by {err:.3g}"
    us = time_calls([lambda j=j: front.launch(x, W[j], pos, cos_sin, slots, kc, vc, nkv, eps, ys[j])
                     for j in range(layers)], samples)
    yb = torch.empty(m, n, dtype=bf, device=dev)
    base = time_calls([lambda w=w: torch.mm(x, w.t(), out=yb) for w in W], samples)
    path = "front" if front_serves(n, m, target) else "gemm+epilogue"
    return row("qkv_front", shard, m, path, us, "torch.mm", base, n * HIDDEN * 2, check)


def bench_norm(shard, m: int, eps: float, l2: int, samples: int) -> dict:
    """qk_norm on the q | k heads of [M, N] projection outputs (rows strided) against the norm in torch ops."""
    import torch

    from ..ops.qk_norm import qk_norm

    n, d, heads = shard.n, shard.head_dim, shard.num_q_heads + shard.num_kv_heads
    bufs = copies(m * heads * d * 2, l2)
    xs = [torch.randn(m, n, device="cuda").to(torch.bfloat16)[:, :heads * d] for _ in range(bufs)]
    outs = [torch.empty(m, heads * d, dtype=torch.bfloat16, device="cuda") for _ in xs]

    def torch_norm(x, o):
        v = x.unflatten(1, (heads, d)).float()
        o.copy_((v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).flatten(1))

    y = qk_norm(xs[0], d, eps, out=outs[0])
    want = torch.empty_like(y)
    torch_norm(xs[0], want)
    ok = torch.allclose(y.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    us = time_calls([lambda x=x, o=o: qk_norm(x, d, eps, out=o) for x, o in zip(xs, outs, strict=True)], samples)
    base = time_calls([lambda x=x, o=o: torch_norm(x, o) for x, o in zip(xs, outs, strict=True)], samples)
    return row("qk_norm", shard, m, "-", us, "torch ops", base, 2 * m * heads * d * 2, "ok" if ok else "differs")


@click.command("bench")
@model_option
@tp_option
@click.option("--m", "ms", type=click.IntRange(1, 16384), multiple=True,
              help=f"Token count(s) M per step (repeatable; default {' '.join(map(str, DEFAULT_MS))}).")
@click.option("--samples", type=click.IntRange(3, 100), default=7, show_default=True,
              help="Graph replays the median is taken over.")
@cache_dir_option
@json_option
def bench_cmd(model_path, tp, ms, samples, cache_dir, as_json):
    """Time your model's qkv_front and qk_norm on this GPU against cuBLAS (torch.mm) and torch: CUDA graphs, CUDA
    events, weights rotated past the L2. Needs a GPU, torch and the prepared kernels (`musekern prepare`)."""
    model = load_model(model_path, tp)
    why = gpu_problem()
    if why:
        raise Failure(why)
    import torch

    from ..runtime import MissingKernelError
    from ..targets import TargetError, check_supported, local_target

    if cache_dir:
        os.environ[CACHE_DIR.name] = str(cache_dir)  # the cache the ops load from, for this process
    dev = torch.cuda.current_device()
    try:
        target = local_target(dev)
        if target is None:
            raise Failure(f"the CUDA driver shows no device {dev} (torch does): check CUDA_VISIBLE_DEVICES")
        check_supported(target)
    except TargetError as e:
        raise Failure(str(e)) from None
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    log(f"musekern bench: {torch.cuda.get_device_name(dev)} (target {target.name}), {model.source}")
    rows = []
    try:
        for shard in model.shards():
            for m in ms or DEFAULT_MS:
                for r in (bench_front(shard, m, model.rms_norm_eps, l2, samples, target),
                          bench_norm(shard, m, model.rms_norm_eps, l2, samples)):
                    log(f"  TP{r['tp']} M={m} {r['op']}: {r['musekern_us']} us, {r['baseline']} {r['baseline_us']} us")
                    rows.append(r)
                torch.cuda.empty_cache()
    except MissingKernelError as e:
        raise Failure(" ".join(str(e).split())) from None
    doc = {"device": torch.cuda.get_device_name(dev), "target": target.name, "model": model.source,
           "torch": torch.__version__, "samples": samples, "warnings": list(model.warnings), "rows": rows}
    if as_json:
        emit_json(doc)
        return
    click.echo(table([[r["op"], r["tp"], r["N"], r["M"], r["path"], f"{r['musekern_us']:.2f}", r["baseline"],
                       f"{r['baseline_us']:.2f}", f"{r['speedup']:.2f}x", f"{r['gbps']:.0f}", r["check"]]
                      for r in rows], HEADERS))


def register(group) -> None:
    group.add_command(bench_cmd)
