"""qk_norm measurements: fraction of copy bandwidth at large M, and the time of one call at M = 16.

The input is the q part of a fused [M, 17408] projection output (TP1's q | k | v | gate), so rows are
strided (row stride 17408, 8192 columns = 128 heads of 64 or 64 heads of 128), as in a decode step.
Large M rotates over several buffers so the bytes come from HBM, not the 60 MB L2. M = 16, the latency
check against the seed kernel's 1.6 us (../shared/anchors/h200-qknorm-seed-kernel.json), runs on the
anchor's own shape: contiguous [16, 4096] rows (64 heads of 64, 32 heads of 128).
"""
from __future__ import annotations

import math

import torch

from . import report
from .timing import Graph, loops_for, time_graphs

WIDTH = 8192  # normed columns per row
ROW_STRIDE = 17408  # the fused projection's row (TP1)
SEED_SHAPE_M, SEED_WIDTH = 16, 4096  # the anchor's M = 16 measurement: [16, heads * head_dim], contiguous
ROTATE_BYTES = 256 << 20  # input bytes touched per rotation: well above the L2
MAX_BUFFERS = 8


def _buffers(m: int) -> int:
    return max(1, min(MAX_BUFFERS, math.ceil(ROTATE_BYTES / (m * WIDTH * 2))))


def measure(copy_tbps: float, ms=(16, 4096, 16384), head_dims=(64, 128), samples: int = 7) -> list[dict]:
    """One row per (head_dim, M): us per call (graph replay, median), TB/s, fraction of copy bandwidth."""
    from musekern.ops.qk_norm import qk_norm

    rows = []
    floor = {}  # the empty kernel's us per launch by graph size: measured once, not per head_dim
    for hd in head_dims:
        for m in ms:
            width, stride = (SEED_WIDTH, SEED_WIDTH) if m == SEED_SHAPE_M else (WIDTH, ROW_STRIDE)
            nb = _buffers(m)
            base = [torch.randn(m, stride, device="cuda").to(torch.bfloat16) for _ in range(nb)]
            xs = [b[:, :width] for b in base]
            outs = [torch.empty(m, width, dtype=torch.bfloat16, device="cuda") for _ in range(nb)]
            closures = [(lambda x=x, o=o, hd=hd: qk_norm(x, hd, 1e-6, out=o)) for x, o in zip(xs, outs, strict=True)]
            per_call_s = max(2 * m * width * 2 / (copy_tbps * 1e12), 1.5e-6)
            g = Graph(f"qk_norm_{hd}_{m}", closures, loops_for(nb * per_call_s, max_loops=512), nb)
            from musekern.reference import qk_norm_reference

            g.replay()
            torch.cuda.synchronize()
            ok = torch.allclose(outs[0].float(), qk_norm_reference(xs[0], hd, 1e-6).float(), rtol=2 ** -7, atol=1e-3)
            us = time_graphs([g], samples)[g.name]["us"]
            row = report.qk_norm_row(hd, m, width, us, copy_tbps)
            row["row_stride"] = stride
            row["output_ok"] = bool(ok)
            if m == SEED_SHAPE_M:
                launches = g.loops * nb
                if launches not in floor:
                    floor[launches] = launch_floor_us(launches, samples)
                row["launch_floor_us"] = floor[launches]
            rows.append(row)
            del g, base, xs, outs
    return rows


def launch_floor_us(loops: int, samples: int) -> float | None:
    """us per launch of an empty kernel in the same graph replay: what a latency-bound call cannot go below
    (qk_norm at M = 16 is read against it; None when no empty kernel can be built)."""
    try:
        from .pred import EmptyKernel

        k = EmptyKernel()
    except Exception:
        return None
    g = Graph("empty_kernel", [k.launch], loops, 1)
    return time_graphs([g], samples)[g.name]["us"]
