"""qkv_front's e4m3 weights (variant weight_dtype "fp8_e4m3", issue 30): the W ring holds e4m3 bytes, and the fp32
multipliers apply to sums. Two arithmetics, by warp_split (rules.py, bench/NOTES.md "e4m3 weights"):

- "k" / "rows", W8A16: the consumer warps dequantize each weight once per CTA into the bf16 MMA's A fragment; x stays
  bf16 (no activation rounding), every e4m3 value is exactly a bf16 one, so the MMA's products are exact and only the
  fp32 accumulation rounds, as in the bf16 front.
- "wg" (one token tile), W8A8: all of the CTA's x lands up front (a barrier per X8_CHUNK k-tiles), is quantized in
  place to e4m3 with a scale per (token, k-tile) as vLLM's block path has it (`fp8.group_scale`; `scaled_e4m3x4`: v
  times 1 / s correctly rounded, vLLM's v / s except where the two straddle a rounding boundary), and wgmma m64n8k32
  e4m3 x e4m3 (QGMMA) reads the ring's W bytes as they are. sm_90a has no e4m3 mma.sync (ptxas unpacks it to
  f16 for HMMA). The error is vLLM's chain's (x per token / 128-group), larger than W8A16's; the speed at TP8 M <= 7
  is why (mma.py `consumer_wg8`).

The W8A16 path:

- The ring: one 128B-swizzled TMA box of 64 rows x 128 e4m3 a stage (8 KiB; the swizzle XORs the 16-byte chunk of a
  row with the row mod 8, as the bf16 ring's boxes do with 64 bf16 a row).
- The fragments (`load_a2`, `load_b`), k permuted within each k16 step: mma.sync m16n8k16's A registers of lane
  (g, t) = (lane / 4, lane % 4) hold rows g and g + 8 at k slots 2t, 2t + 1 and 2t + 8, 2t + 9, its B registers x's
  token g at the same slots. An ldmatrix.x4 of e4m3 rows gives lane (g, t) bytes 4t..4t+3 of a 16-byte chunk (one
  k16 step of a row): slots (2t, 2t + 1) take bytes 4t, 4t + 1 and (2t + 8, 2t + 9) bytes 4t + 2, 4t + 3, and x's
  slots the same columns, 16 kk + 4t..+3, one 8-byte load (a dot product does not depend on the order of its
  terms). One ldmatrix.x4 serves an m16 block's two k16 steps, where 16-bit loads took eight (tests/
  test_kernels_qkv_front.py emulates the mapping lane by lane).
- The conversion (`bf16x2_half`): sm_90 has no e4m3 -> bf16 cvt: cvt.rn.f16x2.e4m3x2 (exact: e4m3 is in f16, subnormals
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
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .ptx import asm
from .variant import HEAD_COLS, K_TILE

ROW_BYTES = K_TILE  # one e4m3 ring row: 128 bytes = one 128B swizzle row
STAGE_BYTES = HEAD_COLS * K_TILE
X_ROW_BYTES = 2 * K_TILE  # one token's bf16 row of an x stage: two 128-byte rows of two 64-column swizzle atoms
ATOM_BYTES = 1024  # one 128B swizzle atom: 8 rows of 128 bytes


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


@cute.jit
def promote2(acc: cute.Tensor, even: cute.Tensor, odd: cute.Tensor, s: Float32):
    """acc += s * (even + odd) (a k-tile's two fp32 sums times its block scale), then both = 0 for the next k-tile."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] + (even[i] + odd[i]) * s
    even.fill(0.0)
    odd.fill(0.0)


@dsl_user_op
def ldsm_x4(addr: Int32, *, loc=None, ip=None):
    """ldmatrix.sync.aligned.m8n8.x4.shared.b16 from this lane's row address (a 32-bit shared address): lane
    (g, t) = (lane / 4, lane % 4) gets bytes 4t..4t+3 of row g of each of the four 8 x 16-byte matrices, whose row
    addresses lanes 8j..8j+7 give. Volatile: it must not move above the mbarrier wait that makes the stage valid."""
    i32 = Int32.mlir_type
    r = llvm.inline_asm(llvm.StructType.get_literal([i32, i32, i32, i32]), [Int32(addr).ir_value(loc=loc, ip=ip)],
                        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                        has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Int32(llvm.extractvalue(i32, r, [k], loc=loc, ip=ip)) for k in range(4)]


@dsl_user_op
def bf16x2_half(word: Int32, high: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """Two e4m3 bytes, the low (high = 0) or high 16 bits of a word (the lower address in the low byte) -> bf16x2
    (the first in the low half), exactly."""
    pick = "h" if high else "l"
    text = ("{\n.reg .b32 f;\n.reg .b16 l, h, lo, hi;\n.reg .f32 a, b;\nmov.b32 {l, h}, $1;\n"
            f"cvt.rn.f16x2.e4m3x2 f, {pick};\nmov.b32 {{lo, hi}}, f;\n"
            "cvt.f32.f16 a, lo;\ncvt.f32.f16 b, hi;\ncvt.rn.bf16x2.f32 $0, b, a;\n}")
    return asm(Int32, text, "=r,r", Int32(word), loc=loc, ip=ip)


class LaneRows:
    """What a lane's ldmatrix row address needs (fixed for the launch): the byte offset of its row within an m16
    block (lanes 8j..8j+7 address matrix j: rows 0-7 (j even) or 8-15 (j odd) of the block, k16 step kk + j / 2)
    and its row mod 8 (the swizzle)."""

    def __init__(self, lane):
        mat, self.rr = lane // 8, lane % 8
        self.row_off = (self.rr + 8 * (mat % 2)) * ROW_BYTES
        self.step = mat // 2


def a_byte(stage, row0, lr: LaneRows, kk):
    """The byte offset in the W ring of this lane's ldmatrix row for `load_a2` (plain arithmetic: the kernel traces
    it, the tests evaluate it)."""
    return stage * STAGE_BYTES + row0 * ROW_BYTES + lr.row_off + (((kk + lr.step) ^ lr.rr) << 4)


def b_byte(stage, g, t, kk, nt, tt: int):
    """The byte offset in the x ring of `load_b`'s 8-byte word for lane (g, t), k16 step kk, token tile nt."""
    return (stage * (tt * X_ROW_BYTES) + ((kk // 4) * (tt // 8) + nt) * ATOM_BYTES + g * ROW_BYTES
            + (((2 * (kk % 4) + t // 2) ^ g) << 4) + 8 * (t % 2))


def x8_src(i, r, c, tt: int):
    """W8A8: the byte offset in the x slots of bf16 chunk c (columns 8c .. 8c + 7) of token r, k-tile i (slot i: the
    TMA's two 64-column 128B-swizzle atoms, rows first; plain arithmetic: the kernel traces it, the tests evaluate
    it)."""
    return (i * (tt * X_ROW_BYTES) + ((c // 8) * (tt // 8) + r // 8) * ATOM_BYTES + (r % 8) * ROW_BYTES
            + (((c % 8) ^ (r % 8)) << 4))


def x8_dst(i, r, d, tt: int):
    """W8A8: the byte offset of e4m3 chunk d (columns 16d .. 16d + 15) of token r, k-tile i, quantized in place: the
    first tt x 128 bytes of slot i as an e4m3 tile's 128B swizzle (8-row atoms, 16-byte chunks XOR row % 8)."""
    return i * (tt * X_ROW_BYTES) + (r // 8) * ATOM_BYTES + (r % 8) * ROW_BYTES + ((d ^ (r % 8)) << 4)


@cute.jit
def load_a2(ring: Int32, a0: cute.Tensor, a1: cute.Tensor, stage, row0, lr: LaneRows, kk):
    """The A registers of one m16 block (rows row0..row0 + 15) for k16 steps kk and kk + 1, one ldmatrix.x4 and
    eight conversions, k permuted within each step: register slots (2t, 2t + 1) and (2t + 8, 2t + 9) hold bytes
    4t, 4t + 1 and 4t + 2, 4t + 3 of the step's 16 (`load_b` reads x in the same order; a dot product does not
    depend on the order of its terms)."""
    d = ldsm_x4(ring + a_byte(stage, row0, lr, kk))
    for j, a in ((0, a0), (1, a1)):
        a[0] = bf16x2_half(d[2 * j], 0)
        a[1] = bf16x2_half(d[2 * j + 1], 0)
        a[2] = bf16x2_half(d[2 * j], 1)
        a[3] = bf16x2_half(d[2 * j + 1], 1)


@cute.jit
def load_b(x64: cute.Tensor, b64: cute.Tensor, stage, g, t, kk, tt: cutlass.Constexpr):
    """x's B registers of k16 step kk, k permuted as `load_a2`'s: for token g of each 8-token tile, bf16 columns
    16 kk + 4t .. + 3 in one 8-byte load from the swizzled x stage (tile nt's atoms at nt, 64-column half kk / 4)."""
    for nt in cutlass.range_constexpr(tt // 8):
        b64[nt] = x64[b_byte(stage, g, t, kk, nt, tt) // 8]


# ---------------------------------------------------------------------------------------------- W8A8 ("wg")

@dsl_user_op
def amax_bf16x4x2(w0: Int32, w1: Int32, w2: Int32, w3: Int32, *, loc=None, ip=None) -> Float32:
    """max |v| over the 8 bf16 values of four words, as fp32 (exact)."""
    text = ("{\n.reg .b32 a, b, c, d;\n.reg .b16 lo, hi;\n.reg .f32 x, y;\n"
            "abs.bf16x2 a, $1;\nabs.bf16x2 b, $2;\nabs.bf16x2 c, $3;\nabs.bf16x2 d, $4;\n"
            "max.bf16x2 a, a, b;\nmax.bf16x2 c, c, d;\nmax.bf16x2 a, a, c;\n"
            "and.b32 b, a, 0xFFFF0000;\nshl.b32 c, a, 16;\nmov.b32 x, b;\nmov.b32 y, c;\nmax.f32 $0, x, y;\n}")
    return asm(Float32, text, "=f,r,r,r,r", *(Int32(w) for w in (w0, w1, w2, w3)), loc=loc, ip=ip)


@dsl_user_op
def scaled_e4m3x4(w0: Int32, w1: Int32, inv: Float32, *, loc=None, ip=None) -> Int32:
    """Four bf16 values (w0 low, w0 high, w1 low, w1 high) times inv -> four e4m3 bytes, the first lowest (round to
    nearest even, saturating)."""
    text = ("{\n.reg .b32 a, b;\n.reg .b16 p, q;\n.reg .f32 x0, x1, x2, x3;\n"
            "shl.b32 a, $1, 16;\nand.b32 b, $1, 0xFFFF0000;\nmov.b32 x0, a;\nmov.b32 x1, b;\n"
            "shl.b32 a, $2, 16;\nand.b32 b, $2, 0xFFFF0000;\nmov.b32 x2, a;\nmov.b32 x3, b;\n"
            "mul.f32 x0, x0, $3;\nmul.f32 x1, x1, $3;\nmul.f32 x2, x2, $3;\nmul.f32 x3, x3, $3;\n"
            "cvt.rn.satfinite.e4m3x2.f32 p, x1, x0;\ncvt.rn.satfinite.e4m3x2.f32 q, x3, x2;\nmov.b32 $0, {p, q};\n}")
    return asm(Int32, text, "=r,r,r,f", Int32(w0), Int32(w1), Float32(inv), loc=loc, ip=ip)
