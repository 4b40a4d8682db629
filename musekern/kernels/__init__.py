"""The kernels, one folder each (musekern/kernels/base.py says what a folder holds), and their registry. Importing this
package, a kernel's package, its variant.py or its abi.py never imports cutlass; only a kernel.py does.

The registry is what the store's variant-vs-ABI check (`import musekern` registers `declared_abi`) and the planner
(musekern/plan.py) stand on: a new kernel is a new folder plus one line in REGISTRY.
"""
from __future__ import annotations

import dataclasses

from ..store.abi import KernelAbi
from . import qk_norm, qkv_epilogue, qkv_front, x_quant
from .base import KernelSpec

REGISTRY: dict[str, KernelSpec] = {k.name: k for k in (
    qk_norm.KERNEL,
    qkv_front.KERNEL,
    qkv_epilogue.KERNEL,
    x_quant.KERNEL,
)}


def kernel_spec(kernel: str) -> KernelSpec:
    """The registry's entry of `kernel`; ValueError naming the known ones."""
    try:
        return REGISTRY[kernel]
    except KeyError:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(REGISTRY)}") from None


def variant_of(kernel: str, params: dict):
    """The variant a manifest or key names: `kernel` with its `params()` (fields at their default may be left out).
    ValueError where the kernel is unknown or the params do not make a valid variant of it."""
    cls = kernel_spec(kernel).variant
    if not isinstance(params, dict):
        raise ValueError(f"{kernel}: variant params must be an object, got {type(params).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - names)
    if unknown:
        raise ValueError(f"{kernel} has no parameter(s) {', '.join(map(str, unknown))}; parameters: "
                         f"{', '.join(sorted(names))}")
    try:
        return cls(**params)
    except TypeError as e:  # a required field missing
        raise ValueError(f"{kernel}{params}: {e}") from None


def declared_abi(kernel: str, params: dict) -> KernelAbi:
    """What the kernel's own ABI record (kernels/<name>/abi.py) declares for the launch of this variant: parameter
    layout, block, cluster, dynamic shared memory, PDL and tensor maps. Cutlass-free and GPU-free: a store-side check
    compares a manifest's `abi` with it (given the manifest's `kernel` and `variant`). ValueError as `variant_of`."""
    return kernel_spec(kernel).abi(variant_of(kernel, params))
