"""qkv_front's e4m3 weights (variant weight_dtype "fp8_e4m3", issue 30): the W ring holds e4m3 bytes, the consumer
warps dequantize each weight once per CTA into the bf16 MMA's A fragment, and the fp32 multipliers apply to sums.

W8A16, not W8A8: x is not quantized (no per-token amax across the split-K cluster, no activation rounding). The MMA is
f16's: every e4m3 value is exactly an f16 one (one conversion a pair), and x goes bf16 -> f16 in registers, exact for
every |x| in [2^-14, 2^16) (f16 holds bf16's 8 significant bits there); smaller values land on f16's subnormal grid
(an absolute error <= 2^-25, far below the fp32 accumulation's). A warp whose x of a stage holds an |x| >= 2^16 (or
an inf or NaN) takes that stage the bf16 way instead (`x_range`, `x_fits`): W f16 -> bf16 (exact), x as loaded, the
bf16 MMA. Either way the products are exact and only the fp32 accumulation rounds, as in the bf16 front.

- The ring: one 128B-swizzled TMA box of 64 rows x 128 e4m3 a stage (8 KiB; the swizzle XORs the 16-byte chunk of a
  row with the row mod 8, as the bf16 ring's boxes do with 64 bf16 a row).
- The fragment (`load_a`): mma.sync m16n8k16's A registers of lane (g, t) = (lane / 4, lane % 4) hold rows g and
  g + 8, k columns 2t, 2t + 1 and 2t + 8, 2t + 9 of a k16 step; each is one 16-bit shared load of two e4m3 bytes
  (both the row's chunk XOR g, since every row a lane reads is g mod 8) and one conversion.
- The conversions: `f16x2` (cvt.rn.f16x2.e4m3x2: one SASS a pair, against four for bf16, which sm_90 cannot convert
  e4m3 to directly: research/fp8.md section 4; Marlin's bit route to bf16 measured 8-10% slower still, bench/NOTES.md)
  and x's `x_f16x2` (two integer operations and one cvt.rn.f16x2.f32 a pair).
- The multipliers (musekern/weights/pack.py's canonical fp32 `weight_scale`): "channel" ([N], per row) scale each
  fp32 partial before it is sent, "block" ([N / 64, 64], per (head, k-tile), a CTA's head being one 64-row group and
  a k-tile one 128-column block) scale each k-tile's fp32 sum before it joins the accumulator (DeepGEMM's
  promotion); a CTA's block scales are staged in shared memory first (`SCALES_SMEM`: read from global per k-tile, the
  L2 latency under the weight stream stalled every k-tile). The scales are weights: read before griddepcontrol.wait,
  like `weight` (ops/qkv_front.py's PDL note).
"""
# (no `from __future__ import annotations`: @cute.jit reads real annotation objects)

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int16, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .variant import HEAD_COLS, K_TILE

ROW_BYTES = K_TILE  # one e4m3 ring row: 128 bytes = one 128B swizzle row
STAGE_HALVES = HEAD_COLS * K_TILE // 2  # 16-bit words a stage


def _asm32(asm: str, *words, loc=None, ip=None) -> Int32:
    """An inline-asm b32 result of b32 operands (`asm`'s $0 the result)."""
    args = [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
    r = llvm.inline_asm(Int32.mlir_type, args, asm, "=r" + ",r" * len(words), has_side_effects=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(r)


@dsl_user_op
def f16x2(pair: Int16, *, loc=None, ip=None) -> Int32:
    """Two e4m3 bytes (the lower address in the low byte) -> f16x2 (the first in the low half), exactly."""
    r = llvm.inline_asm(Int32.mlir_type, [Int16(pair).ir_value(loc=loc, ip=ip)], "cvt.rn.f16x2.e4m3x2 $0, $1;",
                        "=r,h", has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(r)


@dsl_user_op
def bf16x2_of_f16x2(h: Int32, *, loc=None, ip=None) -> Int32:
    """f16x2 -> bf16x2 of a converted weight pair, exactly (a bf16 holds every e4m3 value)."""
    return _asm32("{\n.reg .b16 lo, hi;\n.reg .f32 a, b;\nmov.b32 {lo, hi}, $1;\ncvt.f32.f16 a, lo;\n"
                  "cvt.f32.f16 b, hi;\ncvt.rn.bf16x2.f32 $0, b, a;\n}", h, loc=loc, ip=ip)


@dsl_user_op
def x_f16x2(b: Int32, *, loc=None, ip=None) -> Int32:
    """An x register's bf16x2 -> f16x2 (round to nearest; exact in f16's normal range, see the top)."""
    return _asm32("{\n.reg .b32 lo, hi;\nshl.b32 lo, $1, 16;\nand.b32 hi, $1, 0xFFFF0000;\n"
                  "cvt.rn.f16x2.f32 $0, hi, lo;\n}", b, loc=loc, ip=ip)


@dsl_user_op
def x_range(acc: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """The running per-half maximum of an x register's bf16 magnitudes as bits (an inf's or NaN's above any finite
    value's), to be checked by `x_fits`."""
    return _asm32("{\n.reg .b32 t;\nand.b32 t, $2, 0x7FFF7FFF;\nmax.u16x2 $0, $1, t;\n}", acc, b, loc=loc, ip=ip)


F16_TOO_BIG = 0x4780  # bf16 bits of 2^16: the smallest magnitude f16 cannot hold (65280, the bf16 below, it can)


@dsl_user_op
def x_fits(acc: Int32, *, loc=None, ip=None) -> Int32:
    """1 where both halves of an `x_range` maximum are below 2^16 (every x it saw is finite in f16), else 0."""
    return _asm32("{\n.reg .b32 l, h;\n.reg .pred p;\nand.b32 l, $1, 0xFFFF;\nshr.u32 h, $1, 16;\n"
                  f"setp.lt.u32 p, l, {F16_TOO_BIG};\nsetp.lt.and.u32 p, h, {F16_TOO_BIG}, p;\n"
                  "selp.u32 $0, 1, 0, p;\n}", acc, loc=loc, ip=ip)


def ring_halves(ring_ptr, stages: int):
    """The e4m3 W ring as a flat tensor of 16-bit words (stage s, row r, byte b at (s 8192 + r 128 + b) / 2)."""
    return cute.make_tensor(cute.recast_ptr(ring_ptr, dtype=Int16), cute.make_layout(stages * STAGE_HALVES))


def lane_base(row0, lane):
    """The byte offset of (row row0 + lane / 4, column 2 (lane % 4)) in a stage, unswizzled (row0 a multiple of 8)."""
    return (row0 + lane // 4) * ROW_BYTES + 2 * (lane % 4)


@cute.jit
def load_a(w16: cute.Tensor, a32: cute.Tensor, stage, base, g, kstep: cutlass.Constexpr):
    """The four A registers (a32[0..3], mma.sync register order, f16x2) of one m16 x k16 block: rows of `base`
    (lane_base of the block's first row) and 8 further, k columns 16 kstep + 2t (+1) and + 8 (+9)."""
    off = stage * (2 * STAGE_HALVES) + base + ((g ^ kstep) << 4)
    a32[0] = f16x2(w16[off // 2])
    a32[1] = f16x2(w16[(off + 8 * ROW_BYTES) // 2])
    a32[2] = f16x2(w16[(off + 8) // 2])
    a32[3] = f16x2(w16[(off + 8 * ROW_BYTES + 8) // 2])


@cute.jit
def x_to_f16(xb: cute.Tensor):
    """x's B registers of a stage (an Int32 view) to f16 in place where every x the warp loaded fits f16; returns the
    warp's lanes whose x does not (a ballot: 0, the f16 route; else the registers stay bf16 and the whole warp takes
    the bf16 route this stage)."""
    rng = Int32(0)
    for i in cutlass.range_constexpr(cute.size(xb)):
        rng = x_range(rng, xb[i])
    wide = cute.arch.vote_ballot_sync(x_fits(rng) == Int32(0))
    if wide == Int32(0):
        for i in cutlass.range_constexpr(cute.size(xb)):
            xb[i] = x_f16x2(xb[i])
    return wide


@cute.jit
def a_to_bf16(a32: cute.Tensor):
    """The bf16 route's A registers: each f16x2 weight pair (Int32 view) to bf16x2 in place, exactly."""
    for i in cutlass.range_constexpr(cute.size(a32)):
        a32[i] = bf16x2_of_f16x2(a32[i])


def scale_tensor(ptr, n: int):
    """The canonical fp32 multipliers, N of them either way: [N] per row, or [N / 64 heads, 64 k-tiles] flat (head h's
    k-tile k at 64 h + k)."""
    return cute.make_tensor(ptr, cute.make_layout(n))


@cute.jit
def promote(acc: cute.Tensor, tile_acc: cute.Tensor, s: Float32):
    """acc += s * tile_acc (a k-tile's fp32 sum times its block scale), then tile_acc = 0 for the next k-tile."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] + tile_acc[i] * s
    tile_acc.fill(0.0)
