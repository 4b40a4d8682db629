"""qkv_front's launch ABI: the one record of its parameter order and launch configuration (pure: no cutlass).

kernel.py's `QkvFrontKernel.kernel` takes its parameters in this order; the builder checks the record against the
PTX `.entry` of every build and writes it into the manifest; the op binds its launch values by these names.
"""
from __future__ import annotations

from ...kv_cache import BF16, SCALE_PARAMS
from ...store.abi import KernelAbi, LaunchSpec, TensorMapSpec, coord_tensor, pointer, scalar, tensormap
from .variant import HEAD_COLS, THREADS, QkvFrontVariant, cluster_size, smem_bytes, x_box_rows

BOX_COLS = 64  # a 128B-swizzle TMA box is 64 bf16 columns wide


def abi_for(v: QkvFrontVariant) -> KernelAbi:
    """The launch ABI (pure: no compile). Order = the kernel's argument order (NOTES.md §3)."""
    fp8_w = v.weight_dtype != "bf16"
    w = "e4m3 (u8) [N, 8192], box 128x64" if fp8_w else "bf16 [N, 8192], box 64x64"
    params = [tensormap("tma_w", f"CUtensorMap of weight {w}, 128B swizzle")]
    # mW_tma: fully static shape (N, 8192) -> no parameter
    xb = x_box_rows(v)
    x8 = v.x_dtype != "bf16"  # x quantized ahead (x_quant group 128)
    x = f"e4m3 (u8) [M, 8192], box 128x{xb}" if x8 else f"bf16 [M, 8192], box 64x{xb}"
    params.append(tensormap("tma_x", f"CUtensorMap of x {x}, 128B swizzle (rows >= M: 0)"))
    if not v.fixed_rows:
        params.append(coord_tensor("x_coord", ("M",), "TMA coordinate tensor of x: its dynamic row count M"))
    params += [
        pointer("weight_scale", "float32 dequant multipliers of the e4m3 weight: [N] (channel) or [N / 64, 64] "
                                "(block: per 64 rows x 128 K)") if fp8_w else
        pointer("weight_ptr", "the weight's base address (read by no code since the L2 prefetch lever left; kept "
                              "so the ABI and the cubins stay as they are)"),
        *((pointer("x_scale", "float32 x_quant's scales of x, [M, 64] column-major (token r, 128-column group g "
                              "at g M + r)"),) if x8 else ()),
        pointer("y", "bf16 [M, N] output, contiguous"),
        pointer("positions", "int64 [M]"),
        pointer("cos_sin_cache", "float32 [max_pos, 64] contiguous"),
        pointer("slot_mapping", "int64 [M]"),
        pointer("key_cache", f"{'bf16' if v.kv_cache_dtype == BF16 else 'e4m3 (uint8) bytes'} "
                             "[num_blocks, block_size, num_kv_heads, 64], inner dims contiguous"),
        pointer("value_cache", "same layout as key_cache, own block stride"),
        scalar("max_pos", "i32", "rows of cos_sin_cache"),
        scalar("block_size", "i32"),
        scalar("num_blocks", "i32"),
        scalar("k_block_stride", "i64", "key_cache.stride(0) in elements"),
        scalar("v_block_stride", "i64", "value_cache.stride(0) in elements"),
        scalar("eps", "f32"),
        *(pointer(n, d) if t == "ptr" else scalar(n, t, d) for n, t, d in SCALE_PARAMS if v.kv_cache_dtype != BF16),
    ]
    return KernelAbi(
        params=tuple(params),
        launch=LaunchSpec(block=(THREADS, 1, 1), cluster=(cluster_size(v), 1, 1), dynamic_smem_bytes=smem_bytes(v),
                          pdl=True, grid=f"(heads * S, 1, 1) = ({v.heads} * {v.k_split}, 1, 1)"),
        tensormaps=(TensorMapSpec("tma_w", "weight", "u8", (2 * BOX_COLS, HEAD_COLS)) if fp8_w else
                    TensorMapSpec("tma_w", "weight", "bf16", (BOX_COLS, HEAD_COLS)),
                    TensorMapSpec("tma_x", "x", "u8", (2 * BOX_COLS, xb)) if x8 else
                    TensorMapSpec("tma_x", "x", "bf16", (BOX_COLS, xb))))
