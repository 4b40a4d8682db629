"""The FP8 (e4m3) KV cache store of qkv_front and qkv_epilogue (which imports it from here), in CuTe DSL (sm_89+,
built for sm_90a).

byte = e4m3 round-to-nearest-even, saturated to +-448 (PTX `cvt.rn.satfinite.e4m3x2.f32`: `.satfinite` maps
larger values and infinities to +-448, NaN to 0x7F) of float(k_bf16) / k_scale, the true division's quotient (below):
vLLM's reshape_and_cache_flash bytes (musekern/kv_cache.py, musekern.reference.e4m3_rows). The stores are half the
bf16 path's width: 2 bytes for a lane's RoPE pair, 8 for a lane's 16-byte bf16 vector.

The division without the division: `div.rn.f32` is a branchy sequence ptxas cannot interleave (a k/v lane's eight
in a row measured the FP8 epilogue 1.1-1.7x the bf16 one's time, bench/kv_fp8_bench.py --sweep). A thread instead
takes once (`divisor`) p = 2^-64 where scale > 2^64, 2^100 where scale < 2^-64, else 1 (powers of two: exact),
s' = scale * p and r = 1 / s' (`reciprocal`: rcp.rn's fast path); each value x is then x' = x * p clamped to +-512 s'
(NaN kept: `min.NaN`; any |x / scale| >= 448 saturates anyway), q = x' r, q' = fma(fma(-q, s', x'), r, q) (Markstein's
correction: the correctly rounded quotient when r is, with no over- or underflow) with x's sign (a zero's). Its e4m3
byte is x / scale's for every bf16 x and every positive finite scale: bench/probes/fp8_division.c checks all 65536
bf16 values against each of 40000 scales (every exponent from -149 to 127 with the mantissas 1, 1.5, 1.11..1, and
random ones): 0 mismatches (tests/test_kernels_qkv_front.py runs it with fewer scales where a C compiler is).
A power-of-two scale (1.0, vLLM's default, or ue8m0 ones) takes x * p * r instead: both products exact but for an
over- or underflow, where the byte saturates or is +-0 either way (the probe checks this path too).
A device scale that is not positive and finite stores unspecified bytes (vLLM's division would store its own).

Scales reach a build as two launch values each (musekern/kv_cache.py SCALE_PARAMS): a pointer (0 when the call gave
a float or nothing) and a value; `kv_scale` reads the pointer's float on the device when it is not 0 (after
griddepcontrol.wait, like every input: a CUDA graph replay reads the scale's value then).
"""
# (no `from __future__ import annotations`: @cute.jit reads real annotation objects)

import struct

import cutlass.cute as cute
from cutlass import Float32, Int16, Int32, Int64, Uint8
from cutlass.cute.runtime import make_ptr
from cutlass.cutlass_dsl import dsl_user_op

from ...kv_cache import E4M3_MAX
from ..x_quant.variant import XQ_GROUP_EPS
from .ptx import asm

CACHE_DTYPE = Uint8  # the element type an FP8 build's cache pointers are compiled with (one byte an element)


def compile_scale_args(addr: int) -> tuple:
    """Stand-ins for the four scale arguments at compile time (their values do not matter)."""
    f32 = make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4)
    return (f32, Float32(1.0), f32, Float32(1.0))


def cache_ptr(addr: int):
    """A compile-time stand-in for an FP8 cache pointer (16-byte aligned, as the ops check)."""
    return make_ptr(CACHE_DTYPE, addr, cute.AddressSpace.gmem, assumed_align=16)


@dsl_user_op
def kv_scale(ptr: cute.Pointer, value: Float32, *, loc=None, ip=None) -> Float32:
    """The scale: *ptr where ptr is not 0, else `value`. One predicated load, no branch (a branch around it kept the
    loads after it waiting: the second scale's load issued only once the first had arrived); a side effect, so it
    stays where it is put (after griddepcontrol.wait: a graph replay reads the scale's value then)."""
    return asm(Float32, "{\n.reg .pred p;\nsetp.ne.u64 p, $1, 0;\nmov.b32 $0, $2;\n@p ld.global.f32 $0, [$1];\n}",
               "=f,l,f", ptr.toint(), Float32(value), side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int16:
    """Two e4m3 bytes, `lo` at the lower address (PTX puts the first source in the upper byte)."""
    return asm(Int16, "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f", Float32(hi), Float32(lo), loc=loc, ip=ip)


@dsl_user_op
def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four e4m3 bytes a, b, c, d in address order (little endian: a the low byte)."""
    return asm(Int32, "{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
               "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}",
               "=r,f,f,f,f", *(Float32(v) for v in (a, b, c, d)), loc=loc, ip=ip)


@dsl_user_op
def store_b16(addr: Int64, v: Int16, *, loc=None, ip=None):
    """st.global.b16 [addr], v (2-byte aligned)."""
    asm(None, "st.global.b16 [$0], $1;", "l,h", Int64(addr), Int16(v), side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_b64(addr: Int64, lo: Int32, hi: Int32, *, loc=None, ip=None):
    """st.global.v2.b32 [addr], {lo, hi}: 8 bytes (8-byte aligned)."""
    asm(None, "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", Int64(addr), Int32(lo), Int32(hi), side_effects=True,
        loc=loc, ip=ip)


BIG, SMALL = 2.0 ** 64, 2.0 ** -64  # scales above / below are brought in range by p (see the top)
CLAMP = 512.0  # x * p is clamped to +-CLAMP * s': |quotient| <= 512, never an overflow; any >= 448 saturates
_CLAMP_PTX = "0f" + struct.pack(">f", CLAMP).hex().upper()  # its PTX float literal (0f44000000)


@cute.jit
def divisor(scale: Float32):
    """(s', 1 / s', p) of a scale: what a thread's cache stores divide by (see the top)."""
    p = Float32(1.0)
    if scale > Float32(BIG):
        p = Float32(1.0 / BIG)
    if scale < Float32(SMALL):
        p = Float32(2.0 ** 100)
    s = scale * p
    return (s, reciprocal(s), p, power_of_two(s))


@dsl_user_op
def power_of_two(s: Float32, *, loc=None, ip=None) -> Int32:
    """1 where the normal float s is a power of two (a zero mantissa), else 0."""
    return asm(Int32, "{\n.reg .b32 b;\n.reg .pred z;\nmov.b32 b, $1;\nand.b32 b, b, 0x7FFFFF;\n"
               "setp.eq.u32 z, b, 0;\nselp.u32 $0, 1, 0, z;\n}", "=r,f", Float32(s), loc=loc, ip=ip)


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a / b correctly rounded (div.rn.f32): a scale from an amax (x_quant's, the W8A8 front's; vLLM's amax / 448)."""
    return asm(Float32, "div.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b), loc=loc, ip=ip)


def group_scale(amax: Float32) -> Float32:
    """vLLM's per-token-group scale of a group of max |v| = amax: max(amax, XQ_GROUP_EPS) / 448 correctly rounded
    (x_quant's group build stores it; the W8A8 front's quantizer multiplies each value by its `rcp_rn`)."""
    return div_rn(cute.arch.fmax(amax, Float32(XQ_GROUP_EPS)), Float32(E4M3_MAX))


@dsl_user_op
def rcp_rn(s: Float32, *, loc=None, ip=None) -> Float32:
    """1 / s correctly rounded for every s (rcp.rn.f32, its slow path included: `reciprocal` where s is in range)."""
    return asm(Float32, "rcp.rn.f32 $0, $1;", "=f,f", Float32(s), loc=loc, ip=ip)


@dsl_user_op
def reciprocal(s: Float32, *, loc=None, ip=None) -> Float32:
    """1 / s correctly rounded for s in [2^-64, 2^64]: rcp.rn.f32's own fast path (MUFU.RCP, then one FMA
    correction), which ptxas takes for every s whose exponent is far from both ends; without its slow-path branch
    and call (a call site pins registers: the FP8 epilogue builds held fewer CTAs an SM)."""
    return asm(Float32, "{\n.reg .f32 r, e;\nrcp.approx.ftz.f32 r, $1;\nfma.rn.f32 e, $1, r, 0fBF800000;\n"
               "neg.f32 e, e;\nfma.rn.f32 $0, r, e, r;\n}", "=f,f", Float32(s), loc=loc, ip=ip)


@dsl_user_op
def quotient(x: Float32, d: tuple, *, loc=None, ip=None) -> Float32:
    """x / scale, correctly rounded where it matters to e4m3 (`d`: the scale's `divisor`; see the top). The clamp
    bound CLAMP * s' is formed here (two instructions) rather than held: registers are what the builds lack."""
    s, r, p = (Float32(v) for v in d[:3])
    return asm(Float32, "{\n.reg .f32 xc, q, nq, e, b, nb;\nmul.rn.f32 b, $3, " + _CLAMP_PTX + ";\nneg.f32 nb, b;\n"
               "mul.rn.f32 xc, $1, $4;\nmin.NaN.f32 xc, xc, b;\nmax.NaN.f32 xc, xc, nb;\n"
               "mul.rn.f32 q, xc, $2;\nneg.f32 nq, q;\nfma.rn.f32 e, nq, $3, xc;\n"
               "fma.rn.f32 q, e, $2, q;\ncopysign.f32 $0, xc, q;\n}", "=f,f,f,f,f", Float32(x), r, s, p, loc=loc, ip=ip)


@cute.jit
def store_pair(addr: Int64, a: Float32, b: Float32, d):
    """A lane's RoPE pair (bf16 values as float) to the cache: 2 bytes (`d`: the thread's `divisor`)."""
    if d[3] != Int32(0):  # a power-of-two scale (1.0, vLLM's default): x * p * r is the quotient
        store_b16(addr, e4m3x2(a * d[2] * d[1], b * d[2] * d[1]))
    else:
        store_b16(addr, e4m3x2(quotient(a, d), quotient(b, d)))


@cute.jit
def store_octet(addr: Int64, v, d):
    """A lane's 8 values (a bf16 register tensor) to the cache: 8 bytes (`d`: the thread's `divisor`)."""
    if d[3] != Int32(0):  # a power-of-two scale (1.0, vLLM's default): x * p * r is the quotient
        g = [Float32(v[i]) * d[2] * d[1] for i in range(8)]
        store_b64(addr, e4m3x4(g[0], g[1], g[2], g[3]), e4m3x4(g[4], g[5], g[6], g[7]))
    else:
        f = [quotient(Float32(v[i]), d) for i in range(8)]
        store_b64(addr, e4m3x4(f[0], f[1], f[2], f[3]), e4m3x4(f[4], f[5], f[6], f[7]))
