"""x_quant (issue 30): vLLM's dynamic per-token e4m3 quantization of x, the W8A8 GEMM path's first launch.

    s[r] = max(amax_r / 448, 1 / (448 * 512)),   q[r, c] = e4m3(clamp(x[r, c] / s[r], +-448))

(vLLM's dynamic_per_token_scaled_fp8_quant with no upper bound; musekern.reference.quantize_x_per_token): a true
division (qkv_front/fp8.py's quotient, proven equal to it for every bf16 value), round to nearest even, saturating.
x bf16 [M, 8192] with row stride ld_x, q e4m3 [M, 8192] contiguous, s fp32 [M]. One CTA a row: each of XQ_BLOCK
threads loads XQ_VECS 16-byte vectors (every load before any math), the row's amax in two steps (warp shuffles,
then the 8 warps' through shared memory), then its 8-byte e4m3 stores. Pure Python here (no cutlass).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...model import HIDDEN
from ..base import VariantMixin

XQ_VEC_ELEMS = 8  # bf16 values a 16-byte load
XQ_BLOCK = 256  # threads a CTA (one row)
XQ_VECS = HIDDEN // XQ_VEC_ELEMS // XQ_BLOCK  # 16-byte vectors a thread: 4
XQ_WARPS = XQ_BLOCK // 32
XQ_SMEM_BYTES = 4 * XQ_WARPS  # the warps' amax
XQ_GRID_RULE = f"grid = (M, 1, 1); block = ({XQ_BLOCK}, 1, 1): one CTA a row"
XQ_MAX_ROWS = 2**31 - 1  # grid.x
assert XQ_VECS * XQ_BLOCK * XQ_VEC_ELEMS == HIDDEN


@dataclass(frozen=True)
class XQuantVariant(VariantMixin):
    """The one build (per token); a per-128-group form (block checkpoints) would be a field."""
    kernel: ClassVar[str] = "x_quant"
    sources: ClassVar[tuple[str, ...]] = ("variant.py", "abi.py", "kernel.py", "../qkv_front/fp8.py",
                                          "../../kv_cache.py")


def launch_grid(m: int) -> tuple[int, int, int]:
    return (int(m), 1, 1)
