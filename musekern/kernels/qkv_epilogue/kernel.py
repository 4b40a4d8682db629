"""qkv_epilogue: the attention front's epilogue on a GEMM result from cuBLAS, in CuTe DSL (any M).

Given y = bf16(x @ W^T) [M, N] (columns q | k | v | gate, 64 a head: nq, nkv, nkv, nq heads), in place:
  q, k heads: y <- bf16(rope(rmsnorm(y)))  (unweighted RMS norm over the head's 64 values, fp32 math on the
              bf16 values; interleaved RoPE, pair (2i, 2i+1) = (a, b) -> (a c - b s, a s + b c) with c, s =
              cos_sin_cache[p, i], cos_sin_cache[p, 32 + i], p the token's position clamped to [0, max_pos - 1];
              one rounding at the store);
  k (normed, roped) and v heads -> key_cache / value_cache [num_blocks, block_size, nkv, 64] at block
              slot // block_size, offset slot % block_size, unless slot < 0 or slot >= num_blocks * block_size;
  v and gate heads of y are not written (the gate is not even read).
An FP8 build (variant kv_cache_dtype "fp8_e4m3") stores e4m3(k / k_scale) and e4m3(v / v_scale) bytes instead,
8 bytes a lane (musekern/kernels/qkv_front/fp8.py), the scales read once per thread after griddepcontrol.wait.
That is musekern.reference.fused_qknorm_rope_kv_insert (two tokens with the same valid slot in one call leave
that slot holding, per 16-byte piece, one of their values: undefined, as in the reference).

Work split (constants and the unit mapping: musekern/kernels/qkv_epilogue/variant.py): unit = (row r, lane j, head
group g), units flattened row-major with j fastest; a unit is vector j (y columns 8j..8j+7 of a head: RoPE pairs
4j..4j+3) of the vecs_per_thread heads g*vpt .. g*vpt+vpt-1 (only q, k, v heads; the gate heads are never read).
A thread works on `rounds` units, the grid's thread count apart; before the first it prefetches the later ones'
position, slot and y vectors to the L2. Per unit, in three phases with no branch between the loads:
  1. its row's position and slot and its heads' y vectors (a head past the row's last v head loads the last v
     head instead: in bounds, never stored), all issued before any is used;
  2. the four cos and four sin floats of lane j's pairs (two 16-byte loads from the clamped position's row),
     shared by its heads;
  3. every head's 8 local squares first (so every y load is issued before the first shuffle), then butterfly
     shuffles over the 8 lanes of the (row, head group) round by round, rsqrt, RoPE, and 16-byte stores: y (q, k
     heads), key_cache (k heads), value_cache (v heads, the loaded bits unchanged), each cache store only for a
     valid slot. A lane past the end works on the last unit (in bounds) and stores nothing; the 8 lanes of a
     group are all live or all past the end.
The 8 lanes of a head write one contiguous 128-byte piece of y or of a cache row. No shared memory, no atomics:
the result depends on nothing but the inputs, and not on vecs_per_thread or rounds.

PDL: launched with programmatic stream serialization. Every thread executes griddepcontrol.wait before its first
global read (y comes from the GEMM; positions, slots and the caches may come from earlier kernels), then
griddepcontrol.launch_dependents: the predecessor is complete by then (at most two grids resident), and a
PDL-aware successor (attention) may land its CTAs and prologue while this grid streams; it must wait for this
grid before reading y or the caches, as every PDL dependent must.

Input contract (the op checks it): y, key_cache, value_cache, cos_sin_cache 16-byte aligned; ld_y and the block
strides multiples of 8 elements; M * row_units <= EPI_MAX_UNITS (the Int32 unit index); num_blocks * block_size and
block_size * nkv * 64 < 2^31.
"""
# (no `from __future__ import annotations`: @cute.jit reads real annotation objects)

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.runtime import make_ptr
from cutlass.cutlass_dsl import dsl_user_op

from ...store.keys import variant_tag
from ..qkv_front import fp8 as _fp8
from ..qkv_front.ptx import asm
from .variant import (
    EPI_BLOCK,
    EPI_CTAS_PER_SM,
    EPI_HEAD_DIM,
    EPI_LANES,
    EPI_VEC_ELEMS,
    QkvEpilogueVariant,
)

_VEC = EPI_VEC_ELEMS
_PAIRS = _VEC // 2  # RoPE pairs per 16-byte vector
_CS_VEC = 4  # float32 per 16-byte cos|sin load
_CS_VECS = 2 * EPI_HEAD_DIM // 2 // _CS_VEC  # 16-byte pieces of a cos|sin row: 8 cos, 8 sin
_FAKE_ADDR = 1 << 20  # compile-time stand-in for the device pointers (16-byte aligned)


@dsl_user_op
def _prefetch_l2(addr: Int64, *, loc=None, ip=None):
    """prefetch.global.L2 [addr]: the line comes into the L2; no register waits for it."""
    asm(None, "prefetch.global.L2 [$0];", "l", Int64(addr), side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _pack_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """bf16x2 of two floats (`lo` in the low half), round to nearest even: one F2FP.BF16.F32.PACK_AB. Opaque to
    ptxas on purpose: where the rounded values are also read back as floats (an FP8 build's cache quotients),
    ptxas otherwise rounds each value alone (F2F.BF16.F32: a conversion-unit instruction, 16 results a clock an SM
    against the FMA pipe's 128 in the CUDA programming guide's throughput table; 8 a head in every thread of the
    grid, q threads too) and packs the halves with PRMT."""
    return asm(Uint32, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", Float32(hi), Float32(lo), loc=loc, ip=ip)


class _Tensors(NamedTuple):
    """The global tensors of one launch and the two copy atoms (built once in the kernel)."""
    y: object
    cs: object
    pos: object
    slot: object
    k: object
    v: object
    y_copy: object
    cs_copy: object


class _Unit(NamedTuple):
    """One unit in flight: row r, lane j, first head h0, whether it stores, and its loads."""
    live: object
    r: object
    j: object
    h0: object
    pos: object
    slot: object
    frags: list


class QkvEpilogueKernel:
    """One compiled qkv_epilogue. Static: vectors per thread, rounds. Runtime: everything else."""

    def __repr__(self):
        # CuTe DSL names the compiled kernel after str(self) (the jit's `self` argument, its address dropped): the
        # variant's tag in it makes the entry symbol this variant's alone (store/variant_abi.py refuses a sibling's
        # build, e.g. another vecs_per_thread, under the key by it).
        return f"<musekern.kernels.qkv_epilogue.QkvEpilogueKernel {variant_tag(self.v.kernel, self.v.params())} " \
               f"object at {id(self):#x}>"

    def __init__(self, v: QkvEpilogueVariant):
        self.v = v
        self.vpt = v.vecs_per_thread
        self.fp8 = v.kv_cache_dtype != "bf16"  # e4m3 caches: `kernel_fp8` (four more parameters: the scales)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, y: cute.Pointer, positions: cute.Pointer, cos_sin: cute.Pointer, slots: cute.Pointer,
                 kc: cute.Pointer, vc: cute.Pointer, m: Int32, nq: Int32, nkv: Int32, ld_y: Int32, max_pos: Int32,
                 block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64, eps: Float32,
                 stream: cuda.CUstream, *scales):
        """The launch CuTe would do (the loader reproduces it from the manifest and variants' launch_grid). An FP8
        build takes the four scale arguments (kv_cache.SCALE_PARAMS) after the stream."""
        total = m * ((nq + 2 * nkv + (self.vpt - 1)) // self.vpt * EPI_LANES)  # units
        per_cta = EPI_BLOCK * self.v.rounds  # units of one CTA
        grid_x = (total + (per_cta - 1)) // per_cta
        args = (y, positions, cos_sin, slots, kc, vc, m, nq, nkv, ld_y, max_pos, block_size, num_blocks,
                k_block_stride, v_block_stride, eps)
        if cutlass.const_expr(self.fp8):
            self.kernel_fp8(*args, *scales).launch(grid=[grid_x, 1, 1], block=[EPI_BLOCK, 1, 1], smem=0,
                                                   stream=stream, use_pdl=True, max_number_threads=[EPI_BLOCK, 1, 1],
                                                   min_blocks_per_mp=EPI_CTAS_PER_SM[(self.vpt, self.v.rounds)],
                                                   preferred_smem_carveout=0)
        else:
            self.kernel(*args).launch(grid=[grid_x, 1, 1], block=[EPI_BLOCK, 1, 1], smem=0, stream=stream,
                                      use_pdl=True)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, y: cute.Pointer, positions: cute.Pointer, cos_sin: cute.Pointer, slots: cute.Pointer,
               kc: cute.Pointer, vc: cute.Pointer, m: Int32, nq: Int32, nkv: Int32, ld_y: Int32, max_pos: Int32,
               block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64, eps: Float32):
        """The bf16 builds' entry."""
        self.body(y, positions, cos_sin, slots, kc, vc, m, nq, nkv, ld_y, max_pos, block_size, num_blocks,
                  k_block_stride, v_block_stride, eps, None)

    @cute.kernel
    def kernel_fp8(self, y: cute.Pointer, positions: cute.Pointer, cos_sin: cute.Pointer, slots: cute.Pointer,
                   kc: cute.Pointer, vc: cute.Pointer, m: Int32, nq: Int32, nkv: Int32, ld_y: Int32, max_pos: Int32,
                   block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64, eps: Float32,
                   k_scale_ptr: cute.Pointer, k_scale: Float32, v_scale_ptr: cute.Pointer, v_scale: Float32):
        """The FP8 builds' entry: the bf16 one's parameters, then the scales'."""
        self.body(y, positions, cos_sin, slots, kc, vc, m, nq, nkv, ld_y, max_pos, block_size, num_blocks,
                  k_block_stride, v_block_stride, eps, (k_scale_ptr, k_scale, v_scale_ptr, v_scale))

    @cute.jit
    def body(self, y, positions, cos_sin, slots, kc, vc, m, nq, nkv, ld_y, max_pos, block_size, num_blocks,
             k_block_stride, v_block_stride, eps, scales):
        tidx = cute.arch.thread_idx()[0]
        bidx = cute.arch.block_idx()[0]
        cute.arch.griddepcontrol_wait()  # before any global read: y is the previous grid's output
        cute.arch.griddepcontrol_launch_dependents()

        heads = nq + 2 * nkv  # q, k, v heads of a row (the gate heads are never touched)
        row_units = (heads + (self.vpt - 1)) // self.vpt * EPI_LANES  # units per row
        total = m * row_units
        mY = cute.make_tensor(y, cute.make_layout((m, heads * EPI_LANES, _VEC),
                                                  stride=(cute.assume(Int64(ld_y), divby=_VEC), _VEC, 1)))
        mCS = cute.make_tensor(cos_sin, cute.make_layout((max_pos, _CS_VECS, _CS_VEC),
                                                         stride=(_CS_VECS * _CS_VEC, _CS_VEC, 1)))
        mPos = cute.make_tensor(positions, cute.make_layout(m))
        mSlot = cute.make_tensor(slots, cute.make_layout(m))
        block_vecs = block_size * nkv * EPI_LANES  # 16-byte vectors of one cache block
        mK = cute.make_tensor(kc, cute.make_layout((num_blocks, block_vecs, _VEC),
                                                   stride=(cute.assume(k_block_stride, divby=_VEC), _VEC, 1)))
        mV = cute.make_tensor(vc, cute.make_layout((num_blocks, block_vecs, _VEC),
                                                   stride=(cute.assume(v_block_stride, divby=_VEC), _VEC, 1)))
        y_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        cs_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)

        # this thread's units: w, w + stride, ... (stride = the grid's threads, from the grid rule), one round each.
        # The later rounds' y vectors, positions and slots are first prefetched to the L2 (no register holds them),
        # so their DRAM latency overlaps the earlier rounds' work.
        per_cta = EPI_BLOCK * self.v.rounds
        stride = (total + (per_cta - 1)) // per_cta * EPI_BLOCK
        w = bidx * EPI_BLOCK + tidx
        t = _Tensors(mY, mCS, mPos, mSlot, mK, mV, y_copy, cs_copy)
        for k in cutlass.range_constexpr(1, self.v.rounds):
            self._prefetch(t, w + k * stride, total, row_units, heads, m)
        kv = None  # an FP8 build: (k_scale, v_scale), read once per thread (predicated loads: nothing waits on them)
        if cutlass.const_expr(self.fp8):
            kv = (_fp8.kv_scale(scales[0], scales[1]), _fp8.kv_scale(scales[2], scales[3]))
        for k in cutlass.range_constexpr(self.v.rounds):
            unit = self._load(t, w + k * stride, total, row_units, heads, m)
            self._finish(t, unit, heads, nq, nkv, max_pos, block_size, num_blocks, eps, kv)

    @cute.jit
    def _coords(self, w, total, row_units, m):
        """(live, row r, lane j, first head h0) of unit w; a unit past the end maps to the last unit. bf16 builds:
        row-major (a warp: four head groups of one or two rows). FP8 builds: a warp is one head group of four rows
        (so the k/v groups' e4m3 stores, fp8.py, run in warps of their own instead of holding up three q groups
        each), the warps of four rows taking the row's head groups in turn (so those heavier warps spread evenly
        over the grid's CTAs, not gathered in its last ones); a last block of M % 4 rows likewise with fewer rows
        (variant.py)."""
        live = w < total
        wc = Uint32(cutlass.min(w, total - 1))  # total >= 1: the grid is empty when M == 0
        r = Int32(0)
        j = Int32(0)
        g = Int32(0)
        if cutlass.const_expr(self.fp8):
            t = wc // Uint32(EPI_LANES)  # the unit's 8-lane group, of m * groups
            j = Int32(wc - t * Uint32(EPI_LANES))
            groups = Uint32(row_units // EPI_LANES)
            mu = Uint32(m)
            full = (mu >> 2) * groups * Uint32(4)  # 8-lane groups in whole blocks of four rows
            tail = t >= full  # the last M % 4 rows: one block of fewer rows
            rows = Uint32(4)
            base = Uint32(0)
            if tail:
                rows = mu & Uint32(3)
                base = full
            u = t - base
            q = u // rows  # a warp: (block of four rows, head group), the group fastest; the tail: one block
            blk = q // groups
            g = Int32(q - blk * groups)
            r = Int32(base // groups + (blk << 2) + (u - q * rows))
        else:
            ru = Uint32(row_units)
            r_u = wc // ru
            r = Int32(r_u)
            rem = Int32(wc - r_u * ru)
            j = rem % EPI_LANES
            g = rem // EPI_LANES
        return live, r, j, g * self.vpt

    @cute.jit
    def _prefetch(self, t, w, total, row_units, heads, m):
        """prefetch.global.L2 of what unit w's _load will read: position, slot, its heads' y vectors."""
        _, r, j, h0 = self._coords(w, total, row_units, m)  # (a unit past the end prefetches the last unit's lines)
        _prefetch_l2(t.pos.iterator.toint() + Int64(r) * (Int64.width // 8))
        _prefetch_l2(t.slot.iterator.toint() + Int64(r) * (Int64.width // 8))
        for u in cutlass.range_constexpr(self.vpt):
            _prefetch_l2(t.y[r, cutlass.min(h0 + u, heads - 1) * EPI_LANES + j, None].iterator.toint())

    @cute.jit
    def _load(self, t, w, total, row_units, heads, m):
        """Unit w's row, lane and heads, and its loads issued: position, slot and every y vector, no branch
        between them. A unit past the end works on the last unit (in bounds) and stores nothing; so do the heads
        past the row's last v head (they load the last v head)."""
        live, r, j, h0 = self._coords(w, total, row_units, m)
        pos = t.pos[r]
        slot = t.slot[r]
        frags = []
        for u in cutlass.range_constexpr(self.vpt):
            f = cute.make_rmem_tensor(cute.make_layout(_VEC), BFloat16)
            cute.copy(t.y_copy, t.y[r, cutlass.min(h0 + u, heads - 1) * EPI_LANES + j, None], f)
            frags.append(f)
        return _Unit(live, r, j, h0, pos, slot, frags)

    @cute.jit
    def _finish(self, t, unit, heads, nq, nkv, max_pos, block_size, num_blocks, eps, kv):
        """The unit's cos|sin loads (lane j's four pairs from the clamped position's row, shared by its heads),
        then per head 1 / rms, RoPE and the 16-byte stores (y for q, k heads; the caches for a valid slot: 8 bytes
        of e4m3 in an FP8 build)."""
        r, j, h0, frags = unit.r, unit.j, unit.h0, unit.frags
        p32 = Int32(cutlass.min(cutlass.max(unit.pos, Int64(0)), Int64(max_pos) - Int64(1)))
        cos_f = cute.make_rmem_tensor(cute.make_layout(_CS_VEC), Float32)
        sin_f = cute.make_rmem_tensor(cute.make_layout(_CS_VEC), Float32)
        cute.copy(t.cs_copy, t.cs[p32, j, None], cos_f)
        cute.copy(t.cs_copy, t.cs[p32, _CS_VECS // 2 + j, None], sin_f)
        # slot -> (block, offset): the slot bound is < 2^31 (the op checks it), so a 32-bit division is exact
        limit = Int64(num_blocks) * Int64(block_size)
        cached = unit.live and unit.slot >= Int64(0) and unit.slot < limit
        s32 = Int32(cutlass.min(cutlass.max(unit.slot, Int64(0)), limit - Int64(1)))
        blk = s32 // block_size
        slot_vec0 = (s32 - blk * block_size) * nkv * EPI_LANES + j  # lane j of kv head 0 in the slot
        rs = self._inv_rms(frags, eps)
        for u in cutlass.range_constexpr(self.vpt):
            o = self._roped(frags[u].load().to(Float32), rs[u], cos_f, sin_f)
            h = h0 + u
            if unit.live and h < nq + nkv:
                cute.copy(t.y_copy, o, t.y[r, h * EPI_LANES + j, None])
            if cached and h >= nq:
                if h < nq + nkv:
                    if cutlass.const_expr(self.fp8):
                        # the divisor at each store (a reciprocal, a few instructions): held from the top, its
                        # four values a scale cost the builds a CTA an SM
                        _fp8.store_octet(t.k[blk, slot_vec0 + (h - nq) * EPI_LANES, None].iterator.toint(), o,
                                         _fp8.divisor(kv[0]))
                    else:
                        cute.copy(t.y_copy, o, t.k[blk, slot_vec0 + (h - nq) * EPI_LANES, None])
                elif h < heads:
                    if cutlass.const_expr(self.fp8):
                        _fp8.store_octet(t.v[blk, slot_vec0 + (h - nq - nkv) * EPI_LANES, None].iterator.toint(),
                                         frags[u], _fp8.divisor(kv[1]))
                    else:
                        cute.copy(t.y_copy, frags[u], t.v[blk, slot_vec0 + (h - nq - nkv) * EPI_LANES, None])

    @cute.jit
    def _inv_rms(self, frags, eps):
        """1 / rms of each of this thread's heads: 8 local squares of every head first (so each of its y loads is
        issued before the first shuffle), then butterfly shuffles over the head's 8 lanes (offsets 1, 2, 4), round
        by round across the heads. Every lane runs them (v lanes too, whose
        result is unused): the shuffles need all 32 lanes."""
        ss = []
        for u in cutlass.range_constexpr(self.vpt):
            acc = Float32(0.0)
            xf = frags[u].load().to(Float32)
            for i in cutlass.range_constexpr(_VEC):
                acc = acc + xf[i] * xf[i]
            ss.append(acc)
        for k in cutlass.range_constexpr(EPI_LANES.bit_length() - 1):
            for u in cutlass.range_constexpr(self.vpt):
                ss[u] = ss[u] + cute.arch.shuffle_sync_bfly(ss[u], offset=1 << k)
        return [cute.math.rsqrt(ss[u] * Float32(1.0 / EPI_HEAD_DIM) + eps) for u in range(self.vpt)]

    @cute.jit
    def _roped(self, xf, rs, cos_f, sin_f):
        """bf16 vector of the lane's 4 RoPE pairs, normed by rs: (a, b) -> (a c - b s, a s + b c), one rounding."""
        cv = cos_f.load()
        sv = sin_f.load()
        if cutlass.const_expr(self.fp8):  # its k values are read back as floats: a pair a packed word
            w = cute.make_rmem_tensor(cute.make_layout(_PAIRS), Uint32)
            for i in cutlass.range_constexpr(_PAIRS):
                a = xf[2 * i] * rs
                b = xf[2 * i + 1] * rs
                w[i] = _pack_bf16x2(a * cv[i] - b * sv[i], a * sv[i] + b * cv[i])
            return cute.recast_tensor(w, BFloat16)
        o = cute.make_rmem_tensor(cute.make_layout(_VEC), BFloat16)  # (the bf16 builds: ptxas pairs these itself)
        for i in cutlass.range_constexpr(_PAIRS):
            a = xf[2 * i] * rs
            b = xf[2 * i + 1] * rs
            o[2 * i] = BFloat16(a * cv[i] - b * sv[i])
            o[2 * i + 1] = BFloat16(a * sv[i] + b * cv[i])
        return o


# ---------------------------------------------------------------------- ABI and build
def compile_call(v: QkvEpilogueVariant, arch: str):
    """(the @cute.jit kernel object, its compile arguments in `abi.abi_for`'s order, then the stream, then an FP8
    build's four scale arguments) of `v`; the builder compiles it for `arch` on any machine (no GPU needed)."""
    bf = make_ptr(BFloat16, _FAKE_ADDR, cute.AddressSpace.gmem, assumed_align=16)
    f32 = make_ptr(Float32, _FAKE_ADDR, cute.AddressSpace.gmem, assumed_align=16)
    i64 = make_ptr(Int64, _FAKE_ADDR, cute.AddressSpace.gmem, assumed_align=8)
    fp8 = v.kv_cache_dtype != "bf16"
    kv = _fp8.cache_ptr(_FAKE_ADDR) if fp8 else bf
    return QkvEpilogueKernel(v), (bf, i64, f32, i64, kv, kv, Int32(16), Int32(16), Int32(1), Int32(2176),
                                  Int32(4096), Int32(16), Int32(64), Int64(16 * 64), Int64(16 * 64), Float32(1e-5),
                                  cuda.CUstream(0), *(_fp8.compile_scale_args(_FAKE_ADDR) if fp8 else ()))
