"""qk_norm's launch ABI: the one record of its parameter order and launch configuration (pure: no cutlass).

kernel.py's `qk_norm_host` passes its arguments in this order; the builder checks the record against the PTX
`.entry` of every build and writes it into the manifest; the op binds its launch values by these names.
"""
from __future__ import annotations

from ...store.abi import KernelAbi, LaunchSpec, pointer, scalar
from .variant import QK_NORM_BLOCK, QK_NORM_GRID_RULE, QkNormVariant


def abi_for(variant: QkNormVariant) -> KernelAbi:
    """The launch ABI of `variant` (pure: no compile)."""
    dt = variant.dtype
    return KernelAbi(
        params=(
            pointer("x", f"device address of x: {dt} [m, heads*{variant.head_dim}], row stride ld_x, 16-byte aligned"),
            pointer("out", f"device address of out: {dt} [m, heads*{variant.head_dim}], row stride ld_out, "
                           "16-byte aligned"),
            scalar("m", "i32", "rows (tokens)"),
            scalar("heads", "i32", "head_dim groups per row"),
            scalar("ld_x", "i32", "row stride of x in elements, a multiple of 8"),
            scalar("ld_out", "i32", "row stride of out in elements, a multiple of 8"),
            scalar("eps", "f32", "added to the mean of squares"),
            scalar("scale", "f32", "output scale" + ("" if variant.has_scale else " (ignored: has_scale=False)")),
        ),
        launch=LaunchSpec(block=(QK_NORM_BLOCK, 1, 1), cluster=(1, 1, 1), dynamic_smem_bytes=0, pdl=False,
                          grid=QK_NORM_GRID_RULE),
    )
