"""qkv_front's shared memory: the swizzled W / x ring with its TMA atoms, and the CTA's @cute.struct (kernel.py's
docstring has the roles; variant.py `ring_smem_bytes` the size this struct must have)."""
# (no `from __future__ import annotations`: @cute.struct reads real annotation objects)

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from .variant import HEAD_COLS, K_TILE, SCALES_SMEM, X8_CHUNK


def ring_tma(mW, mX, stages: int, tt: int, x_mcast: bool = False, x_slots: int = 0):
    """The ring's swizzled shared-memory layouts and the W / x TMA atoms (traced inside a @cute.jit): one
    stage = W (64 rows x 128 k) and x (tt rows x 128 k), each two 64-column boxes with 128B swizzle (an e4m3 W:
    one 128-column box); with `x_mcast` each CTA of a head pair loads half of the x rows and multicasts them to both.
    Shared with bench/probes/skeleton_probe.py, whose ring must be this one."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, mX.element_type)
    w_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, mW.element_type)
    sW_layout = cute.tile_to_shape(w_atom, (HEAD_COLS, K_TILE, stages), order=(0, 1, 2))
    sX_layout = cute.tile_to_shape(atom, (tt, K_TILE, x_slots or stages), order=(0, 1, 2))
    tma_w, mW_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                cute.slice_(sW_layout, (None, None, 0)), (HEAD_COLS, K_TILE))
    # one stage's x layout built as such: the DSL aborts slicing a stage out of the staged layout when tt is an odd
    # multiple of 8 rows (24, 40, 56); for other tt it is the slice
    sX_stage = cute.tile_to_shape(atom, (tt, K_TILE), order=(0, 1))
    if x_mcast:
        tma_x, mX_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), mX, sX_stage,
                                                    (tt, K_TILE), num_multicast=2)
    else:
        tma_x, mX_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX, sX_stage, (tt, K_TILE))
    return sW_layout, sX_layout, tma_w, mW_tma, tma_x, mX_tma


def make_smem_struct(stages: int, tt: int, owned: int, recv_in_ring: bool, w_type=BFloat16, block_scales=False,
                     x8: int = 0, x_type=BFloat16):
    """The CTA's shared memory, one @cute.struct (offsets in this order; `smem_bytes` is its size)."""
    fields = {
        # ring first: offset 0 of the 1024-aligned dynamic smem, what the 128B swizzle expects
        "sW": cute.struct.Align[cute.struct.MemRange[w_type, HEAD_COLS * K_TILE * stages], 1024],
        "sX": cute.struct.Align[cute.struct.MemRange[x_type, tt * K_TILE * (x8 or stages)], 1024],
        "full": cute.struct.MemRange[Int64, stages],  # TMA -> consumers: count 1 + W and x bytes
        "empty": cute.struct.MemRange[Int64, stages],  # consumers -> producer: count 4 x pair (one lane a warp)
        "recv_bar": cute.struct.MemRange[Int64, 1],  # partials landed (st.async complete_tx bytes)
        "slots": cute.struct.MemRange[Int64, owned],  # staged slot of each owned token
        # cos|sin rows of the owned tokens (sized by them: with one tile at S = 2 this is what lets a 6-stage
        # ring fit two CTAs per SM, bench/NOTES.md round 17)
        "cs": cute.struct.Align[cute.struct.MemRange[Float32, owned * 64], 16],
    }
    if not recv_in_ring:  # else the receive buffer is the W ring's first tt x 64 fp32 (`QkvFrontKernel.recv`)
        fields["recv"] = cute.struct.Align[cute.struct.MemRange[Float32, tt * HEAD_COLS], 16]  # [src][j][col]
    if block_scales:  # e4m3 weights with block scales: the CTA's k-tiles' multipliers, staged (w8.py)
        fields["wscale"] = cute.struct.Align[cute.struct.MemRange[Float32, SCALES_SMEM], 16]
    if x8:  # W8A8 ("wg" e4m3 builds, x8 = the CTA's k-tiles): all of x landed; its scales a token and 32 columns
        fields["xfull"] = cute.struct.MemRange[Int64, x8 // X8_CHUNK]  # TMA -> quantizers: a chunk's x landed
        # aux -> consumers: a chunk quantized (x quantized ahead: cfull[0], the scales staged)
        fields["cfull"] = cute.struct.MemRange[Int64, x8 // X8_CHUNK]
        fields["xs"] = cute.struct.Align[cute.struct.MemRange[Float32, x8 * tt], 16]
    return cute.struct(type("Smem", (), {"__annotations__": fields}))
