"""What every kernel offers the planner, the store and the builder (pure Python: no cutlass, no GPU).

A kernel is one folder `musekern/kernels/<name>/`:
    variant.py   its frozen variant dataclass (a `VariantMixin`), shape constants and launch geometry (pure)
    abi.py       `abi_for(variant) -> KernelAbi`: the one launch ABI record (pure): parameter order, block, cluster,
                 dynamic shared memory, PDL, tensor maps; the builder checks it against the PTX once per build and
                 writes it into the manifest, the runtime binds launch values by its names
    kernel.py    the CuTe DSL kernel (imports cutlass; only the builder imports it): `compile_call(variant, arch)`
                 -> (the @cute.jit function, its compile arguments)
    __init__.py  `KERNEL = KernelSpec(...)`: what `musekern/plan.py`'s registry lists (one line a kernel)
The variant class names the files whose bytes define what it compiles to (`sources`, relative to its folder: its own
and, as ../k/x.py, another kernel's file it compiles from, e.g. the FP8 KV cache store): they and
`COMMON_SOURCES` make the source hash of its cache key (store/keys.py reads them; the store names no kernel).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

from ..store.keys import variant_label

PACKAGE = Path(__file__).resolve().parent.parent  # the musekern package directory
# Files every kernel's build depends on (package-relative): the shape constants, the compile helper and the ABI
# record's format.
# store/keys.py: its variant_tag is compiled into every entry symbol
COMMON_SOURCES = ("model.py", "builder/dsl.py", "store/abi.py", "store/keys.py")


class VariantMixin:
    """Mixed into each kernel's frozen variant dataclass.

    `params()` is the variant's named parts, the unit of the cache key (never positional). A field at its
    default is left out of params, labels and keys: adding a lever (with the old behaviour as its default)
    leaves every existing key as it was, and dropping an unused one does too.
    """

    kernel: ClassVar[str] = ""  # overridden per kernel
    # the files of the kernel's folder whose bytes define what it compiles to and what its manifest says (not its
    # planning rules: a rule change picks other builds, it never changes what a build is)
    sources: ClassVar[tuple[str, ...]] = ("variant.py", "abi.py", "kernel.py")

    def params(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                out[f.name] = value
        return out

    @property
    def label(self) -> str:
        return variant_label(self.kernel, self.params())

    def to_json(self) -> str:
        return json.dumps({"kernel": self.kernel, **self.params()}, sort_keys=True)

    @classmethod
    def source_files(cls) -> tuple[Path, ...]:
        """The files the key's source hash covers, in a fixed order (the kernel's own, then the common ones)."""
        folder = Path(sys.modules[cls.__module__].__file__).resolve().parent
        return tuple((folder / f).resolve() for f in cls.sources) + tuple(PACKAGE / f for f in COMMON_SOURCES)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel, as the registry (musekern/plan.py) lists it."""
    name: str
    variant: type  # the frozen variant dataclass; variant.kernel == name
    # (model, shard, target) -> the variants one TP shard of the model needs on the target
    planned: Callable
    # variant -> KernelAbi: what the kernel declares for its launch (pure; musekern.kernels.declared_abi)
    abi: Callable
    # the CuTe DSL module (imports cutlass): `compile_call(variant, arch)` (only the builder imports it)
    kernel_module: str
    # (variant, model, shard, target) -> dict: the kernel's own columns of a `musekern plan` row
    plan_row: Callable = lambda v, model, shard, target: {}
