"""x_quant's launch ABI: the one record of its parameter order and launch configuration (pure: no cutlass)."""
from __future__ import annotations

from ...store.abi import KernelAbi, LaunchSpec, pointer, scalar
from .variant import XQ_BLOCK, XQ_GRID_RULE, XQ_SMEM_BYTES, XQuantVariant


def abi_for(variant: XQuantVariant) -> KernelAbi:
    """The launch ABI of `variant` (pure: no compile)."""
    return KernelAbi(
        params=(
            pointer("x", "bf16 [M, 8192], row stride ld_x, 16-byte aligned"),
            pointer("q", "e4m3 (u8) [M, 8192] contiguous, 16-byte aligned"),
            pointer("scale", "float32 dequant multipliers: [M] per token; [M, 64] column-major per group"),
            scalar("ld_x", "i32", "row stride of x in elements, a multiple of 8"),
            scalar("m", "i32", "rows of q and the scales (x's rows, or more where the caller pads): the group "
                   "scales' column stride"),
        ),
        launch=LaunchSpec(block=(XQ_BLOCK, 1, 1), cluster=(1, 1, 1), dynamic_smem_bytes=XQ_SMEM_BYTES, pdl=True,
                          grid=XQ_GRID_RULE),
    )
