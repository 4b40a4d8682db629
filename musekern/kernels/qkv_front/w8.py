"""qkv_front's e4m3 weights (variant weight_dtype "fp8_e4m3", issue 30): the W ring holds e4m3 bytes, the consumer
warps dequantize each weight once per CTA into the bf16 MMA's A fragment, and the fp32 multipliers apply to sums.

W8A16, not W8A8: x stays bf16 (no per-token amax across the split-K cluster, no activation rounding), every e4m3 value
is exactly a bf16 one, so the MMA's products are exact and only the fp32 accumulation rounds, as in the bf16 front.

- The ring: one 128B-swizzled TMA box of 64 rows x 128 e4m3 a stage (8 KiB; the swizzle XORs the 16-byte chunk of a
  row with the row mod 8, as the bf16 ring's boxes do with 64 bf16 a row).
- The fragment (`load_a`): mma.sync m16n8k16's A registers of lane (g, t) = (lane / 4, lane % 4) hold rows g and
  g + 8, k columns 2t, 2t + 1 and 2t + 8, 2t + 9 of a k16 step; each is one 16-bit shared load of two e4m3 bytes
  (both the row's chunk XOR g, since every row a lane reads is g mod 8) and one conversion.
- The conversion (`bf16x2`): sm_90 has no e4m3 -> bf16 cvt: cvt.rn.f16x2.e4m3x2 (exact: e4m3 is in f16, subnormals
  too), two cvt.f32.f16, cvt.rn.bf16x2.f32 (exact: 4 mantissa bits fit bf16's 8). research/fp8.md section 4; Marlin's
  bit route (integer ops and a bf16x2 multiply by 2^120) measured 8-10% slower at every shard (bench/NOTES.md).
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


@dsl_user_op
def bf16x2(pair: Int16, *, loc=None, ip=None) -> Int32:
    """Two e4m3 bytes (the lower address in the low byte) -> bf16x2 (the first in the low half), exactly."""
    asm = ("{\n.reg .b32 f;\n.reg .b16 lo, hi;\n.reg .f32 a, b;\ncvt.rn.f16x2.e4m3x2 f, $1;\nmov.b32 {lo, hi}, f;\n"
           "cvt.f32.f16 a, lo;\ncvt.f32.f16 b, hi;\ncvt.rn.bf16x2.f32 $0, b, a;\n}")
    r = llvm.inline_asm(Int32.mlir_type, [Int16(pair).ir_value(loc=loc, ip=ip)], asm, "=r,h",
                        has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(r)


def ring_halves(ring_ptr, stages: int):
    """The e4m3 W ring as a flat tensor of 16-bit words (stage s, row r, byte b at (s 8192 + r 128 + b) / 2)."""
    return cute.make_tensor(cute.recast_ptr(ring_ptr, dtype=Int16), cute.make_layout(stages * STAGE_HALVES))


def lane_base(row0, lane):
    """The byte offset of (row row0 + lane / 4, column 2 (lane % 4)) in a stage, unswizzled (row0 a multiple of 8)."""
    return (row0 + lane // 4) * ROW_BYTES + 2 * (lane % 4)


@cute.jit
def load_a(w16: cute.Tensor, a32: cute.Tensor, stage, base, g, kstep: cutlass.Constexpr):
    """The four A registers (a32[0..3], mma.sync register order) of one m16 x k16 block: rows of `base` (lane_base
    of the block's first row) and 8 further, k columns 16 kstep + 2t (+1) and + 8 (+9)."""
    off = stage * (2 * STAGE_HALVES) + base + ((g ^ kstep) << 4)
    a32[0] = bf16x2(w16[off // 2])
    a32[1] = bf16x2(w16[(off + 8 * ROW_BYTES) // 2])
    a32[2] = bf16x2(w16[(off + 8) // 2])
    a32[3] = bf16x2(w16[(off + 8 * ROW_BYTES + 8) // 2])


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
