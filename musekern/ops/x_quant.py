"""The x_quant kernel's launches (kernels/x_quant): e4m3 quantization of x for the W8A8 GEMM path of FP8 weights
(gemm/fp8.py). `quantize(x)` -> (q float8_e4m3fn [M, 8192], s float32 [M, 1]), bit for bit
musekern.reference.quantize_x_per_token's (vLLM's dynamic per-token quantization); `quantize(x, group=128)` -> (q, s
float32 [M, 64] column-major), musekern.reference.quantize_x_per_group's (per_token_group_quant_fp8, the layout
torch._scaled_mm's 1x128 block scaling reads). One launch on torch's current stream, no host sync; `prepare(device,
group)` loads the build (before a CUDA-graph capture). No checks: the op that calls it has checked x (bf16 [M, 8192],
16-byte aligned rows, on the device).
"""
from __future__ import annotations

import functools

import torch

from ..kernels.x_quant.variant import XQ_GROUP, XQ_GROUPS, XQuantVariant, launch_grid
from ..model import HIDDEN
from . import checks


@functools.lru_cache(maxsize=None)
def prepare(device_index: int, group: int = 0):
    """The loaded x_quant build (`group` 0: per token, 128: per group) on this device (MissingKernelError naming
    `musekern prepare` where it is not in the cache)."""
    from ..runtime import get_kernel

    return get_kernel(XQuantVariant(group=group), device=device_index, on_miss=checks.on_miss())


def quantize(x: torch.Tensor, group: int = 0, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) of x [M, 8192] bf16 on a CUDA device, q = e4m3(x / s): group 0, s = max(amax / 448, 1 / (448 * 512))
    per row, [M, 1]; group 128, s = max(amax, 1e-10) / 448 per row and 128 columns, [M, 64] column-major. `rows` > M
    pads both to that many rows (q 0, s 1: a GEMM whose shape rules want M rounded up reads finite rows)."""
    m = x.shape[0]
    rows = m if rows is None else rows
    q = torch.empty(rows, HIDDEN, dtype=torch.float8_e4m3fn, device=x.device)
    s = (torch.empty(XQ_GROUPS, rows, dtype=torch.float32, device=x.device).t() if group
         else torch.empty(rows, 1, dtype=torch.float32, device=x.device))
    if rows > m:
        q[m:].view(torch.uint8).zero_()
        s[m:].fill_(1.0)
    if m:
        prepare(x.get_device(), group).launch_ordered(launch_grid(m), [x.data_ptr(), q.data_ptr(), s.data_ptr(),
                                                                       x.stride(0), rows])
    return q, s


def quantize_groups_at(x_ptr: int, m: int, ld_x: int, device_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize(x, 128)` of the bf16 x [m, 8192] at address x_ptr (row stride ld_x) on the device: the fused front's
    W8A8 builds that read x quantized ahead (their launch values carry x's address)."""
    dev = torch.device("cuda", device_index)
    q = torch.empty(m, HIDDEN, dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty(XQ_GROUPS, m, dtype=torch.float32, device=dev).t()
    prepare(device_index, XQ_GROUP).launch_ordered(launch_grid(m), [x_ptr, q.data_ptr(), s.data_ptr(), ld_x, m])
    return q, s
