"""x_quant (variant.py has the contract) as a CuTe DSL kernel: one CTA a row of x.

Thread t loads vectors t, t + 256, t + 512, t + 768 of its row (16 bytes each, all four before any math). Per token:
their |x| folded into one max, the warp's max by butterfly shuffles, the row's from the 8 warps' in shared memory;
s = max(amax / 448 (div.rn), 1 / (448 * 512)); thread 0 stores s. Per group: vector v is columns 8v..8v+7, so the 16
lanes of a half warp hold one 128-column group at each step; its max by 4 butterfly shuffles (offsets 1..8 stay in
the half warp), s = max(amax, 1e-10) / 448 (div.rn), the half warp's first lane stores it. Each value's byte is e4m3
of the true quotient x / s (qkv_front/fp8.py `divisor` and `quotient`; x * p * r for a power-of-two s), 8 bytes a
vector with one store.
"""
# (no `from __future__ import annotations`: @cute.struct and @cute.jit read real annotation objects)

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator

from ...kv_cache import E4M3_MAX
from ...model import HIDDEN
from ...store.keys import variant_tag
from ..qkv_front import fp8 as _fp8
from .variant import XQ_BLOCK, XQ_GROUP_LANES, XQ_GROUPS, XQ_VEC_ELEMS, XQ_VECS, XQ_WARPS, XQuantVariant

MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)  # vLLM's min_scaling_factor (musekern.reference.FP8_MIN_SCALE)
_FAKE_ADDR = 0x10000


@cute.struct
class Smem:
    red: cute.struct.MemRange[Float32, XQ_WARPS]


@cute.kernel
def x_quant_kernel(x: cute.Pointer, q: cute.Pointer, scale: cute.Pointer, ld_x: Int32, m: Int32,
                   group: cutlass.Constexpr, tag: cutlass.Constexpr):
    # `tag` (store.keys.variant_tag) only names the kernel's entry symbol
    tidx = cute.arch.thread_idx()[0]
    row = cute.arch.block_idx()[0]
    # PDL: the next grid (a front) may launch and start its weight prefetch at once, even before this one's wait;
    # x may be the previous grid's output
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()
    ldx = cute.assume(Int64(ld_x), divby=XQ_VEC_ELEMS)
    mX = cute.make_tensor(x, cute.make_layout((row + 1, HIDDEN // XQ_VEC_ELEMS, XQ_VEC_ELEMS),
                                              stride=(ldx, XQ_VEC_ELEMS, 1)))
    vec_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    frags = []
    for u in cutlass.range_constexpr(XQ_VECS):
        f = cute.make_rmem_tensor(cute.make_layout(XQ_VEC_ELEMS), BFloat16)
        cute.copy(vec_copy, mX[row, u * XQ_BLOCK + tidx, None], f)
        frags.append(f)
    base = q.toint() + Int64(row) * HIDDEN
    if cutlass.const_expr(group == 0):
        sc = _row_scale(frags, tidx)
        if tidx == 0:
            cute.make_tensor(scale, cute.make_layout(row + 1))[row] = sc
        d = _fp8.divisor(sc)
        for u in cutlass.range_constexpr(XQ_VECS):
            _fp8.store_octet(base + (u * XQ_BLOCK + tidx) * XQ_VEC_ELEMS, frags[u], d)
    else:
        mS = cute.make_tensor(scale, cute.make_layout(Int64(m) * XQ_GROUPS))
        for u in cutlass.range_constexpr(XQ_VECS):
            sc = _fp8.group_scale(_half_warp_amax(frags[u]))
            if tidx % XQ_GROUP_LANES == 0:
                mS[Int64((u * XQ_BLOCK + tidx) // XQ_GROUP_LANES) * Int64(m) + row] = sc
            _fp8.store_octet(base + (u * XQ_BLOCK + tidx) * XQ_VEC_ELEMS, frags[u], _fp8.divisor(sc))


@cute.jit
def _abs_max(frag) -> Float32:
    v = frag.load().to(Float32)
    a = Float32(0.0)
    for i in cutlass.range_constexpr(XQ_VEC_ELEMS):
        a = cute.arch.fmax(a, cute.math.absf(v[i]))
    return a


@cute.jit
def _half_warp_amax(frag) -> Float32:
    """The |x| max of the 16 lanes' vectors (a 128-column group: offsets 1, 2, 4, 8 stay in the half warp)."""
    a = _abs_max(frag)
    for s in cutlass.range_constexpr(4):
        a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=1 << s))
    return a


@cute.jit
def _row_scale(frags, tidx) -> Float32:
    """max(amax / 448, MIN_SCALE) of the row: each warp's max by shuffles, the row's from the warps' in shared
    memory."""
    warp = tidx // 32
    lane = tidx % 32
    amax = Float32(0.0)
    for u in cutlass.range_constexpr(XQ_VECS):
        amax = cute.arch.fmax(amax, _abs_max(frags[u]))
    for s in cutlass.range_constexpr(5):  # offsets 1, 2, 4, 8, 16
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << s))
    st = SmemAllocator().allocate(Smem)
    red = st.red.get_tensor(cute.make_layout(XQ_WARPS))
    if lane == 0:
        red[warp] = amax
    cute.arch.sync_threads()
    amax = red[0]
    for w in cutlass.range_constexpr(1, XQ_WARPS):
        amax = cute.arch.fmax(amax, red[w])
    return cute.arch.fmax(_fp8.div_rn(amax, Float32(E4M3_MAX)), Float32(MIN_SCALE))


@cute.jit
def x_quant_host(x: cute.Pointer, q: cute.Pointer, scale: cute.Pointer, ld_x: Int32, m: Int32, stream: cuda.CUstream,
                 group: cutlass.Constexpr, tag: cutlass.Constexpr):
    """The launch CuTe would do (the runtime loader reproduces it from the manifest + launch_grid)."""
    x_quant_kernel(x, q, scale, ld_x, m, group, tag).launch(grid=[m, 1, 1], block=[XQ_BLOCK, 1, 1],
                                                            smem=Smem.size_in_bytes(), stream=stream,
                                                            use_pdl=True)


def compile_call(variant: XQuantVariant, arch: str):
    """(the @cute.jit function, its compile arguments: the ABI's values, then M, the stream and the tag)."""
    x = make_ptr(BFloat16, _FAKE_ADDR, cute.AddressSpace.gmem, assumed_align=16)
    q = _fp8.cache_ptr(_FAKE_ADDR)
    s = make_ptr(Float32, _FAKE_ADDR, cute.AddressSpace.gmem, assumed_align=16)
    return x_quant_host, (x, q, s, Int32(HIDDEN), Int32(16), cuda.CUstream(0), variant.group,
                          variant_tag(variant.kernel, variant.params()))
