"""qk_norm (seed 002) as a CuTe DSL kernel: unweighted RMS norm over every head_dim group.

    out[r, h*hd + j] = round(float(x[r, h*hd + j]) * rsqrt(mean_j float(x[r, h*hd + :])^2 + eps) [* scale])

x is [m, heads*hd] with row stride ld_x (elements, last dim contiguous), out is [m, heads*hd] with
row stride ld_out. fp32 math, one rounding at the store.

Work split (constants from variant.py, the single source of truth):
- the input is walked as V = m*heads*hd/8 16-byte vectors in flattened row-major order; vector v is
  row v // (heads*L), column vector v % (heads*L), with L = hd/8 lanes per (row, head) group;
- CTA b, thread t owns vectors b*TILE + u*BLOCK + t, u < VECS_PER_THREAD: all its loads are issued
  before any math (VECS_PER_THREAD x 16 B in flight per thread), consecutive lanes read consecutive
  16-byte vectors (a warp reads 512 contiguous bytes unless it crosses a row end);
- the L lanes of one group are consecutive and L-aligned (L divides BLOCK and the row length in
  vectors), so the sum of squares is reduced with log2(L) butterfly shuffles that stay inside the
  group; a group is either wholly in range or wholly out (V is a multiple of L), and every lane
  runs the shuffles (full mask); a lane past the end loads the last vector (in bounds, so the loads
  need no branch and all issue back to back) and stores nothing.
No shared memory, no atomics; the result depends on nothing but the inputs.

Input contract (the op checks it): x, out 16-byte aligned; ld_x, ld_out multiples of 8 elements;
m*heads*hd/8 <= QK_NORM_MAX_VECTORS (Int32 vector index). out may alias x exactly (in place)
because every element is read and written by the same thread, read first; partial overlap is not allowed.

ABI: kernel params (x: ptr, out: ptr, m: i32, heads: i32, ld_x: i32, ld_out: i32, eps: f32, scale: f32),
all plain PTX params. `scale` stays in the signature for has_scale=False (ignored there) so every
variant packs the same arguments.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.runtime import make_ptr

from ...store.keys import variant_tag
from .variant import QK_NORM_BLOCK, QK_NORM_VEC_ELEMS, QkNormVariant

_DTYPES = {"bfloat16": BFloat16, "float16": Float16}
_VEC = QK_NORM_VEC_ELEMS
_BLOCK = QK_NORM_BLOCK
_FAKE_ADDR = 0x10000  # compile-time stand-in for the device pointers (16-byte aligned)


@cute.kernel
def qk_norm_kernel(x: cute.Pointer, out: cute.Pointer, m: Int32, heads: Int32, ld_x: Int32, ld_out: Int32,
                   eps: Float32, scale: Float32, head_dim: cutlass.Constexpr, has_scale: cutlass.Constexpr,
                   vpt: cutlass.Constexpr, tag: cutlass.Constexpr):
    # `tag` (store.keys.variant_tag) only names the kernel: CuTe DSL appends constexpr arguments to the entry symbol,
    # so the symbol is this variant's alone (store/variant_abi.py refuses a sibling's build under the key by it)
    lanes = head_dim // _VEC  # lanes per (row, head) group: 8, 16 or 32
    tidx = cute.arch.thread_idx()[0]
    bidx = cute.arch.block_idx()[0]
    ncol = heads * lanes  # 16-byte vectors per row
    total = m * ncol
    # 16-byte alignment of every row start: the op guarantees ld % 8 == 0; 64-bit row offsets
    ldx = cute.assume(Int64(ld_x), divby=_VEC)
    ldo = cute.assume(Int64(ld_out), divby=_VEC)
    mX = cute.make_tensor(x, cute.make_layout((m, ncol, _VEC), stride=(ldx, _VEC, 1)))
    mO = cute.make_tensor(out, cute.make_layout((m, ncol, _VEC), stride=(ldo, _VEC, 1)))
    vec_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), x.dtype, num_bits_per_copy=128)

    base = bidx * (_BLOCK * vpt) + tidx
    last = total - 1  # >= 0: the grid is empty when total == 0
    ncol_u = Uint32(ncol)
    rows = []
    cols = []
    live = []
    frags = []
    # phase 1: issue every load before any math, with no branch between them. A lane past the end
    # loads the last vector instead (in bounds, never stored): its whole group is past the end too,
    # so the shuffles below never mix it with live data.
    for u in cutlass.range_constexpr(vpt):
        v = base + u * _BLOCK
        live.append(v < total)
        vc = Uint32(cutlass.min(v, last))
        r = vc // ncol_u
        rows.append(Int32(r))
        cols.append(Int32(vc - r * ncol_u))
        f = cute.make_rmem_tensor(cute.make_layout(_VEC), x.dtype)
        cute.copy(vec_copy, mX[rows[u], cols[u], None], f)
        frags.append(f)
    # phase 2: per vector, group sum of squares -> rsqrt -> scale -> one rounding -> 16-byte store
    for u in cutlass.range_constexpr(vpt):
        xf = frags[u].load().to(Float32)
        ss = Float32(0.0)
        for i in cutlass.range_constexpr(_VEC):
            ss = ss + xf[i] * xf[i]
        for s in cutlass.range_constexpr(lanes.bit_length() - 1):  # offsets 1, 2, .. lanes/2
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1 << s)
        rs = cute.math.rsqrt(ss * (1.0 / head_dim) + eps)
        if cutlass.const_expr(has_scale):
            rs = rs * scale
        o = cute.make_rmem_tensor(cute.make_layout(_VEC), out.dtype)
        o.store((xf * rs).to(out.dtype))
        if live[u]:
            cute.copy(vec_copy, o, mO[rows[u], cols[u], None])


@cute.jit
def qk_norm_host(x: cute.Pointer, out: cute.Pointer, m: Int32, heads: Int32, ld_x: Int32, ld_out: Int32,
                 eps: Float32, scale: Float32, stream: cuda.CUstream, head_dim: cutlass.Constexpr,
                 has_scale: cutlass.Constexpr, vpt: cutlass.Constexpr, tag: cutlass.Constexpr):
    """The launch CuTe would do (the runtime loader reproduces it from the manifest + launch_grid)."""
    total = m * heads * (head_dim // _VEC)
    tile = _BLOCK * vpt
    grid_x = (total + (tile - 1)) // tile
    qk_norm_kernel(x, out, m, heads, ld_x, ld_out, eps, scale, head_dim, has_scale, vpt, tag).launch(
        grid=[grid_x, 1, 1], block=[_BLOCK, 1, 1], smem=0, stream=stream)


def compile_call(variant: QkNormVariant, arch: str):
    """(the @cute.jit function, its compile arguments in `abi.abi_for`'s order, then the stream and constexprs) of
    `variant`; the builder compiles it for `arch` ("sm_90a", "sm_100a", ...) on any machine (no GPU needed)."""
    dtype = _DTYPES[variant.dtype]
    x = make_ptr(dtype, _FAKE_ADDR, cute.AddressSpace.gmem, assumed_align=16)
    o = make_ptr(dtype, _FAKE_ADDR, cute.AddressSpace.gmem, assumed_align=16)
    row = variant.head_dim * 8
    return qk_norm_host, (x, o, Int32(16), Int32(8), Int32(row), Int32(row), Float32(1e-5), Float32(1.0),
                          cuda.CUstream(0), variant.head_dim, bool(variant.has_scale), variant.vecs_per_thread,
                          variant_tag(variant.kernel, variant.params()))
