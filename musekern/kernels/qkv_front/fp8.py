"""The FP8 (e4m3) KV cache store of qkv_front and qkv_epilogue (which imports it from here), in CuTe DSL (sm_89+,
built for sm_90a).

byte = e4m3 round-to-nearest-even, saturated to +-448 (PTX `cvt.rn.satfinite.e4m3x2.f32`: `.satfinite` maps
larger values and infinities to +-448, NaN to 0x7F) of float(k_bf16) / k_scale, a true division (`div.rn.f32`, what
the DSL emits for `/` on Float32; tests/test_kernels_qkv_*.py check the PTX for both): vLLM's reshape_and_cache_flash
bytes (musekern/kv_cache.py, musekern.reference.e4m3_rows). The stores are half the bf16 path's width: 2 bytes for a
lane's RoPE pair, 8 for a lane's 16-byte bf16 vector.

Scales reach a build as two launch values each (musekern/kv_cache.py SCALE_PARAMS): a pointer (0 when the call gave
a float or nothing) and a value; `kv_scale` reads the pointer's float on the device when it is not 0 (after
griddepcontrol.wait, like every input: a CUDA graph replay reads the scale's value then).
"""
# (no `from __future__ import annotations`: @cute.jit reads real annotation objects)

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int16, Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_ptr
from cutlass.cutlass_dsl import dsl_user_op

CACHE_DTYPE = Uint8  # the element type an FP8 build's cache pointers are compiled with (one byte an element)


def compile_scale_args(addr: int) -> tuple:
    """Stand-ins for the four scale arguments at compile time (their values do not matter)."""
    f32 = make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4)
    return (f32, Float32(1.0), f32, Float32(1.0))


def cache_ptr(addr: int):
    """A compile-time stand-in for an FP8 cache pointer (16-byte aligned, as the ops check)."""
    return make_ptr(CACHE_DTYPE, addr, cute.AddressSpace.gmem, assumed_align=16)


@cute.jit
def kv_scale(ptr: cute.Pointer, value: Float32) -> Float32:
    """The scale: *ptr where ptr is not 0, else `value`."""
    s = value
    if ptr.toint() != Int64(0):
        s = cute.make_tensor(ptr, cute.make_layout(1))[0]
    return s


@dsl_user_op
def e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int16:
    """Two e4m3 bytes, `lo` at the lower address (PTX puts the first source in the upper byte)."""
    r = llvm.inline_asm(Int16.mlir_type, [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                        "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f", has_side_effects=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int16(r)


@dsl_user_op
def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four e4m3 bytes a, b, c, d in address order (little endian: a the low byte)."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)]
    r = llvm.inline_asm(Int32.mlir_type, args,
                        "{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
                        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}",
                        "=r,f,f,f,f", has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(r)


@dsl_user_op
def store_b16(addr: Int64, v: Int16, *, loc=None, ip=None):
    """st.global.b16 [addr], v (2-byte aligned)."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int16(v).ir_value(loc=loc, ip=ip)],
                    "st.global.b16 [$0], $1;", "l,h", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT,
                    loc=loc, ip=ip)


@dsl_user_op
def store_b64(addr: Int64, lo: Int32, hi: Int32, *, loc=None, ip=None):
    """st.global.v2.b32 [addr], {lo, hi}: 8 bytes (8-byte aligned)."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(lo).ir_value(loc=loc, ip=ip),
                           Int32(hi).ir_value(loc=loc, ip=ip)],
                    "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def store_pair(addr: Int64, a: Float32, b: Float32, scale: Float32):
    """A lane's RoPE pair (bf16 values as float) to the cache: 2 bytes."""
    store_b16(addr, e4m3x2(a / scale, b / scale))


@cute.jit
def store_octet(addr: Int64, v, scale: Float32):
    """A lane's 8 values (a bf16 register tensor) to the cache: 8 bytes."""
    f = []
    for i in cutlass.range_constexpr(8):
        f.append(Float32(v[i]) / scale)
    store_b64(addr, e4m3x4(f[0], f[1], f[2], f[3]), e4m3x4(f[4], f[5], f[6], f[7]))
