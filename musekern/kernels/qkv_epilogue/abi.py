"""qkv_epilogue's launch ABI: the one record of its parameter order and launch configuration (pure: no cutlass).

kernel.py's `QkvEpilogueKernel.__call__` passes its arguments in this order; the builder checks the record against
the PTX `.entry` of every build and writes it into the manifest; the op binds its launch values by these names.
"""
from __future__ import annotations

from ...kv_cache import BF16, SCALE_PARAMS
from ...store.abi import KernelAbi, LaunchSpec, pointer, scalar
from .variant import EPI_BLOCK, EPI_GRID_RULE, QkvEpilogueVariant


def abi_for(v: QkvEpilogueVariant) -> KernelAbi:
    """The launch ABI of `v` (pure: no compile). Order = the kernel's argument order."""
    cache = "bf16" if v.kv_cache_dtype == BF16 else "e4m3 (uint8) bytes"
    return KernelAbi(
        params=(
            pointer("y", "bf16 [M, N] GEMM result, q|k|v|gate, row stride ld_y, 16-byte aligned; q, k heads "
                         "rewritten in place"),
            pointer("positions", "int64 [M]"),
            pointer("cos_sin_cache", "float32 [max_pos, 64] contiguous, 16-byte aligned"),
            pointer("slot_mapping", "int64 [M]; < 0 or >= num_blocks * block_size: nothing written"),
            pointer("key_cache", f"{cache} [num_blocks, block_size, num_kv_heads, 64], inner dims contiguous, "
                                 "16-byte aligned"),
            pointer("value_cache", "same layout as key_cache, own block stride"),
            scalar("M", "i32", "rows of y (tokens)"),
            scalar("num_q_heads", "i32", "nq: q heads (= gate heads) per row"),
            scalar("num_kv_heads", "i32", "nkv: k heads (= v heads) per row"),
            scalar("ld_y", "i32", "row stride of y in elements, a multiple of 8"),
            scalar("max_pos", "i32", "rows of cos_sin_cache"),
            scalar("block_size", "i32"),
            scalar("num_blocks", "i32"),
            scalar("k_block_stride", "i64", "key_cache.stride(0) in elements, a multiple of 8"),
            scalar("v_block_stride", "i64", "value_cache.stride(0) in elements, a multiple of 8"),
            scalar("eps", "f32", "added to the mean of squares"),
            *(pointer(n, d) if t == "ptr" else scalar(n, t, d) for n, t, d in SCALE_PARAMS
              if v.kv_cache_dtype != BF16),  # an FP8 build's entry `kernel_fp8`: the scales
        ),
        launch=LaunchSpec(block=(EPI_BLOCK, 1, 1), cluster=(1, 1, 1), dynamic_smem_bytes=0, pdl=True,
                          grid=EPI_GRID_RULE),
    )
