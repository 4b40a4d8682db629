"""Compile one planned variant to a cubin with the CuTe DSL (no GPU needed) and check it.

The builder is the only package that imports cutlass (through builder/dsl.py and the kernels' kernel.py modules),
and only inside `compile_variant`. Each build's declared ABI (kernels/<name>/abi.py) is checked against its PTX
`.entry` once, in `build_variant`.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

from .. import targets
from ..plan import kernel_spec
from ..store.abi import KernelAbi, check_abi_against_ptx, cubin_arch
from ..store.keys import DSL_DISTRIBUTION, dsl_version

BUILD_EXTRA_HINT = "pip install 'musekern[build]'  (adds nvidia-cutlass-dsl, needed to compile kernels)"


class BuildError(RuntimeError):
    pass


class BuildExtraMissing(BuildError):
    def __init__(self):
        super().__init__(f"nvidia-cutlass-dsl is not installed, so kernels cannot be compiled here. "
                         f"Install the build extra: {BUILD_EXTRA_HINT}")


@dataclass(frozen=True)
class CompiledKernel:
    symbol: str
    cubin: bytes
    ptx: str
    abi: KernelAbi  # what the kernel declares (kernels/<name>/abi.py); `build_variant` checks it against the PTX


@dataclass(frozen=True)
class Built:
    cubin: bytes
    manifest: dict  # the builder's part of manifest.json (the cache adds key, hashes, format)


def compile_variant(variant, arch: str) -> CompiledKernel:
    """Compile `variant` for `arch` (imports cutlass: needs the `build` extra). NotImplementedError where the
    arch is not one musekern builds for (targets.SUPPORTED_ARCHES) or the variant cannot be built for it."""
    if arch not in targets.SUPPORTED_ARCHES:
        raise NotImplementedError(f"{variant.label}: musekern's kernels build for "
                                  f"{' / '.join(targets.SUPPORTED_ARCHES)}; {arch} is not supported")
    spec = kernel_spec(variant.kernel)
    from .dsl import compile_to_cubin  # (first: it switches the DSL's own file cache off before cutlass loads)

    fn, args = importlib.import_module(spec.kernel_module).compile_call(variant, arch)
    cubin, ptx, symbol = compile_to_cubin(fn, *args, arch=arch)
    return CompiledKernel(symbol=symbol, cubin=cubin, ptx=ptx, abi=spec.abi(variant))


def build_variant(variant, arch: str) -> Built:
    """Compile `variant` for `arch` and check the artifact before it may enter the cache."""
    version = dsl_version()
    if version is None:
        raise BuildExtraMissing()
    try:
        ck = compile_variant(variant, arch)
    except ImportError as e:
        raise BuildError(f"compiling {variant.label} failed to import the CuTe DSL ({e}); {BUILD_EXTRA_HINT}") from e
    try:
        got = cubin_arch(ck.cubin)
    except ValueError as e:
        raise BuildError(f"{variant.label}: the compiler's output is not a cubin ({e})") from None
    if got != arch:
        raise BuildError(f"{variant.label}: asked for {arch}, the cubin's ELF header says {got}")
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    isa = re.search(r"\.version\s+(\S+)", ck.ptx)
    manifest = {
        "kernel": variant.kernel,
        "label": variant.label,
        "variant": variant.params(),
        "symbol": ck.symbol,
        "arch": arch,
        "abi": ck.abi.to_json(),
        "built_with": {DSL_DISTRIBUTION: version, "options": f"--gpu-arch {arch}",
                       "ptx_isa": isa.group(1) if isa else None},
    }
    return Built(ck.cubin, manifest)
