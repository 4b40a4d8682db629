"""Build: compile one planned variant to a cubin with the CuTe DSL (no GPU needed) and check it.

The only module besides `musekern/kernels/` that imports cutlass, and only inside `build_variant`.
"""
from __future__ import annotations

import importlib.metadata
import re
import struct
from dataclasses import dataclass

from .cache import KeyParts
from .kernels import abi as abi_mod
from .kernels import source_hash

DSL_DISTRIBUTION = "nvidia-cutlass-dsl"
BUILD_EXTRA_HINT = "pip install 'musekern[build]'  (adds nvidia-cutlass-dsl, needed to compile kernels)"

EM_CUDA = 190  # ELF e_machine of a cubin


class BuildError(RuntimeError):
    pass


class BuildExtraMissing(BuildError):
    def __init__(self):
        super().__init__(f"nvidia-cutlass-dsl is not installed, so kernels cannot be compiled here. "
                         f"Install the build extra: {BUILD_EXTRA_HINT}")


def dist_version(dist: str) -> str | None:
    """An installed distribution's version from package metadata (imports nothing), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_version() -> str | None:
    """Installed nvidia-cutlass-dsl version (does not import cutlass)."""
    return dist_version(DSL_DISTRIBUTION)


def key_parts(variant, arch: str, dsl_version: str | None = None) -> KeyParts:
    """The named parts of the cache key of `variant` built for `arch` (a PlanEntry is accepted too)."""
    variant = getattr(variant, "variant", variant)
    return KeyParts.make(kernel=variant.kernel, variant_params=variant.params(), arch=arch,
                         source_sha256=source_hash(variant.kernel), dsl_version=dsl_version or "",
                         abi_version=abi_mod.ABI_VERSION)


def cubin_arch(cubin: bytes) -> str:
    """The SM a cubin was compiled for, from its ELF header: 'sm_90a', 'sm_100a', 'sm_80', ...

    CUDA ELF ABI v7 (up to sm_90): SM in e_flags bits 0-7, arch-specific ('a') flag 0x800.
    ABI v8 (sm_100 on): SM in bits 8-15, 'a' flag 0x8. Checked against cubins built for
    sm_80, sm_90, sm_90a and sm_100a by CuTe DSL 4.8.1.
    """
    if len(cubin) < 0x34 or cubin[:4] != b"\x7fELF":
        raise BuildError("not an ELF file")
    machine = struct.unpack_from("<H", cubin, 0x12)[0]
    if machine != EM_CUDA:
        raise BuildError(f"ELF machine {machine} is not CUDA ({EM_CUDA})")
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    if cubin[8] >= 8:
        sm, accel = (flags >> 8) & 0xFF, bool(flags & 0x8)
    else:
        sm, accel = flags & 0xFF, bool(flags & 0x800)
    return f"sm_{sm}{'a' if accel else ''}"


@dataclass(frozen=True)
class Built:
    cubin: bytes
    manifest: dict  # the builder's part of manifest.json (the cache adds key, hashes, format)


def build_variant(variant, arch: str) -> Built:
    """Compile `variant` for `arch` and check the artifact before it may enter the cache."""
    version = dsl_version()
    if version is None:
        raise BuildExtraMissing()
    from . import kernels

    try:
        ck = kernels.compile_variant(variant, arch)
    except ImportError as e:
        raise BuildError(f"compiling {variant.label} failed to import the CuTe DSL ({e}); {BUILD_EXTRA_HINT}") from e
    got = cubin_arch(ck.cubin)
    if got != arch:
        raise BuildError(f"{variant.label}: asked for {arch}, the cubin's ELF header says {got}")
    abi_mod.check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
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
