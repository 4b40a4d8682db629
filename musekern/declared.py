"""The launch ABI each variant's kernel declares, without cutlass: the provider of the store's variant-vs-ABI
check (store/variant_abi.py), registered by `import musekern` (musekern/__init__.py).

MERGE: `declared_abi` is where the cutlass-free declaration of the kernel refactor plugs in (the kernel's
`abi_for(variant)` moved out of the CuTe DSL modules, with the variant built from its params). On this branch
the only `abi_for` are in musekern/kernels/<kernel>.py, which import cutlass at module level: the runtime, verify
and import must not, so nothing is declared yet and the check passes every ABI through.
"""
from __future__ import annotations


def declared_abi(kernel: str, params: dict):
    """The KernelAbi the variant `params` of `kernel` declares; ValueError for a variant this musekern does not
    know; None where no declaration is available (no check)."""
    return None
