"""CUDA-graph and event helpers: one way to build, check and time a graph, shared by every mode.

Why graphs: a decode step replays a graph, and the launch gaps an eager loop adds would swamp a
~9 us kernel. Why torch.cuda.graph: the cuBLAS/unfused baselines allocate inside the capture and need
torch's graph memory pool; the fronts' cuLaunchKernelEx calls go to the same (capture) stream, where
the PDL attribute becomes a programmatic edge (counted here when torch keeps the raw graph).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch

# BENCH_GRAPH_BLAS=clear: cuBLAS's workspaces dropped before and after each capture (what torch's inductor does), so a
# graph's cuBLAS calls take a workspace from its own memory pool instead of the one cached for the capture stream
CLEAR_BLAS = os.environ.get("BENCH_GRAPH_BLAS", "keep") == "clear"
# BENCH_GRAPH_STREAM=own: each graph captured on a stream of its own (its warm-up's) instead of torch's default capture
# stream, which every graph shares
OWN_STREAM = os.environ.get("BENCH_GRAPH_STREAM", "shared") == "own"
TARGET_REPLAY_S = 1.5e-3  # GPU time per graph replay: launch + event noise stay far below 1%
MAX_LOOPS = 48


def log(msg: str) -> None:
    """Progress goes to stderr (stdout carries the results)."""
    print(msg, file=sys.stderr, flush=True)


def loops_for(sequence_s: float, target_s: float = TARGET_REPLAY_S, max_loops: int = MAX_LOOPS) -> int:
    """How many copies of a layer sequence one graph holds so that a replay is >= target_s of GPU work."""
    if sequence_s <= 0:
        return max_loops
    return max(1, min(max_loops, math.ceil(target_s / sequence_s)))


def _edge_stats(raw_graph) -> dict:
    """Nodes, edges and programmatic (PDL) edges of a captured graph (diagnostic: was PDL kept?)."""
    from cuda.bindings import driver as drv

    g = drv.CUgraph(raw_graph)
    err, _, nn = drv.cuGraphGetNodes(g, 0)
    res = drv.cuGraphGetEdges(g, 0)
    ne = res[-1]
    st = {"nodes": int(nn), "edges": int(ne), "programmatic": 0}
    if ne:
        outs = drv.cuGraphGetEdges(g, ne)
        if len(outs) != 5 and hasattr(drv, "cuGraphGetEdges_v2"):  # cuda.bindings 12.x
            outs = drv.cuGraphGetEdges_v2(g, ne)
        data = outs[3] if len(outs) == 5 else None
        prog = int(drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        for d in data or []:
            t = d.type
            t = t[0] if isinstance(t, (bytes, bytearray)) else int(t)
            st["programmatic"] += t == prog
    return st


class Graph:
    """`loops` copies of a list of launch closures, captured once; replay() launches them all."""

    def __init__(self, name: str, closures: list, loops: int, layers: int):
        self.name, self.loops, self.layers = name, loops, layers
        self.edges = None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: tensor maps encoded, cuBLAS handles made, outside capture
            for f in closures:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            g = torch.cuda.CUDAGraph(keep_graph=True)
            kept = True
        except TypeError:  # older torch: no raw graph to inspect
            g, kept = torch.cuda.CUDAGraph(), False
        if CLEAR_BLAS:
            torch._C._cuda_clearCublasWorkspaces()
        with torch.cuda.graph(g, stream=side if OWN_STREAM else None):
            for _ in range(loops):
                for f in closures:
                    f()
        if CLEAR_BLAS:
            torch._C._cuda_clearCublasWorkspaces()
        if kept:
            try:
                self.edges = _edge_stats(g.raw_cuda_graph())
            except Exception as e:  # diagnostic only
                self.edges = {"error": f"{type(e).__name__}: {e}"}
            g.instantiate()
        self.graph = g

    def replay(self) -> None:
        self.graph.replay()


def time_graphs(graphs: list[Graph], samples: int, reps: int = 2) -> dict[str, dict]:
    """Median us per layer of each graph; samples are taken round robin (drift hits all graphs alike).

    A sample: one lead-in replay (so the GPU is busy when the first event is recorded and no host gap
    is timed), event, `reps` replays, event. us per layer = elapsed / (reps * loops * layers).
    """
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for g in graphs:
        g.replay()
        g.replay()
    torch.cuda.synchronize()
    ts = {g.name: [] for g in graphs}
    for _ in range(samples):
        for g in graphs:
            g.replay()
            e0.record()
            for _ in range(reps):
                g.replay()
            e1.record()
            e1.synchronize()
            ts[g.name].append(e0.elapsed_time(e1) * 1e3 / (reps * g.loops * g.layers))
    return {g.name: {"us": statistics.median(ts[g.name]), "samples": [round(t, 4) for t in ts[g.name]],
                     "loops": g.loops, "edges": g.edges} for g in graphs}


def copy_closures(nbytes: int, count: int) -> list:
    """`count` device copies, each over its own buffer pair, that move `nbytes` (half read, half written): a graph of
    them is the streaming reference for a kernel that moves as many bytes (its buffers rotated as the copies are)."""
    pairs = [torch.empty(2, nbytes // 4, dtype=torch.bfloat16, device="cuda") for _ in range(count)]
    return [lambda b=b: b[1].copy_(b[0]) for b in pairs]


def copy_bandwidth(samples: int = 5, nbytes: int = 2 << 30) -> float:
    """TB/s of a 2 GiB device-to-device copy, bytes read + written (the roofline's ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(samples):
        e0.record()
        for _ in range(3):
            dst.copy_(src)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3 / 3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(ts) / 1e12


class Stopwatch:
    """Wall time since start, for the stderr progress lines (the whole run must stay well under 9 min)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __str__(self) -> str:
        return f"[{time.perf_counter() - self.t0:6.1f}s]"
