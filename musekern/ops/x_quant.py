"""The x_quant kernel's launch (kernels/x_quant): per-token e4m3 quantization of x for the W8A8 GEMM path of FP8
weights (gemm/fp8.py). `quantize(x)` -> (q float8_e4m3fn [M, 8192], s float32 [M, 1]), bit for bit
musekern.reference.quantize_x_per_token's (vLLM's dynamic per-token quantization), one launch on torch's current
stream, no host sync; `prepare(device)` loads the build (before a CUDA-graph capture). No checks: the op that calls it
has checked x (bf16 [M, 8192], 16-byte aligned rows, on the device).
"""
from __future__ import annotations

import functools

import torch

from ..kernels.x_quant.variant import XQuantVariant, launch_grid
from ..model import HIDDEN
from . import checks


@functools.lru_cache(maxsize=None)
def prepare(device_index: int):
    """The loaded x_quant build on this device (MissingKernelError naming `musekern prepare` where it is not in the
    cache)."""
    from ..runtime import get_kernel

    return get_kernel(XQuantVariant(), device=device_index, on_miss=checks.on_miss())


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) of x [M, 8192] bf16 on a CUDA device: s = max(amax / 448, 1 / (448 * 512)) per row, q = e4m3(x / s)."""
    m = x.shape[0]
    q = torch.empty(m, HIDDEN, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        prepare(x.get_device()).launch_ordered(launch_grid(m), [x.data_ptr(), q.data_ptr(), s.data_ptr(),
                                                                x.stride(0)])
    return q, s
