"""x_quant (issue 30): vLLM's dynamic e4m3 quantizations of x, the W8A8 GEMM path's first launch. Two builds:

- group = 0, per token (per-row weight scales; vLLM's dynamic_per_token_scaled_fp8_quant with no upper bound,
  musekern.reference.quantize_x_per_token):
      s[r] = max(amax_r / 448, 1 / (448 * 512)),   q[r, c] = e4m3(clamp(x[r, c] / s[r], +-448)); s fp32 [M]
- group = 128, per token and 128-column group (block checkpoints; vLLM's per_token_group_quant_fp8,
  musekern.reference.quantize_x_per_group):
      s[r, g] = max(amax_{r,g}, 1e-10) / 448,   q[r, c] = e4m3(clamp(x[r, c] / s[r, c // 128], +-448));
  s fp32 [M, 64] column-major (s[r, g] at g * M + r: the layout torch._scaled_mm's 1x128 block scaling reads).

Both: divisions correctly rounded (div.rn for amax / 448; qkv_front/fp8.py's quotient, proven equal to x / s for every
bf16 value), round to nearest even, saturating. x bf16 [M, 8192] with row stride ld_x, q e4m3 [M, 8192] contiguous.
One CTA a row: each of XQ_BLOCK threads loads XQ_VECS 16-byte vectors (every load before any math); per token the
row's amax in two steps (warp shuffles, then the 8 warps' through shared memory), per group a half warp's shuffles
(16 lanes x 8 values = one group); then the 8-byte e4m3 stores. Pure Python here (no cutlass).
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
XQ_GROUP = 128  # columns of one scale in the group build (the checkpoints' weight blocks in K)
XQ_GROUP_EPS = 1e-10  # vLLM's floor on a group's amax (per_token_group_quant_fp8's eps; musekern.reference's too)
XQ_GROUP_LANES = XQ_GROUP // XQ_VEC_ELEMS  # a half warp: one group a vector step
XQ_GROUPS = HIDDEN // XQ_GROUP  # scales a row
assert XQ_VECS * XQ_BLOCK * XQ_VEC_ELEMS == HIDDEN and XQ_BLOCK % XQ_GROUP_LANES == 0


@dataclass(frozen=True)
class XQuantVariant(VariantMixin):
    """`group`: columns a scale covers, 0 (the whole row: per token) or XQ_GROUP."""
    kernel: ClassVar[str] = "x_quant"
    sources: ClassVar[tuple[str, ...]] = ("variant.py", "abi.py", "kernel.py", "../qkv_front/fp8.py",
                                          "../qkv_front/ptx.py", "../../kv_cache.py")
    group: int = 0

    def __post_init__(self):
        if self.group not in (0, XQ_GROUP):
            raise ValueError(f"x_quant group must be 0 (per token) or {XQ_GROUP}, got {self.group!r}")


def launch_grid(m: int) -> tuple[int, int, int]:
    return (int(m), 1, 1)
