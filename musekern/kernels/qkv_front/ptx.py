"""Inline PTX for the CuTe DSL kernels (fp8.py, w8.py and qkv_epilogue call it; x_quant through fp8.py): one statement
with its operands typed, the llvm.inline_asm call spelled once."""
# (no `from __future__ import annotations`: the DSL reads real annotation objects)

from cutlass._mlir.dialects import llvm


def asm(ret, text: str, constraints: str, *args, side_effects: bool = False, loc=None, ip=None):
    """`text` (AT&T operand numbering: $0 the result where there is one, then `args` in order) under `constraints`;
    `args` are DSL scalars of the types the constraints name. Returns a `ret` (a DSL scalar type), or None where ret
    is None (a statement for its side effect). `side_effects`: the statement stays where it is put and is never
    dropped (a load that must not move above a wait, a store)."""
    r = llvm.inline_asm(None if ret is None else ret.mlir_type, [a.ir_value(loc=loc, ip=ip) for a in args], text,
                        constraints, has_side_effects=side_effects, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return None if ret is None else ret(r)
