"""CuTe DSL kernel sources. Importing this package does NOT import cutlass: each kernel
module is imported lazily by `compile_variant`, only on machines that build kernels.

Contract for a kernel module `musekern/kernels/<name>.py`:
  compile_variant(variant, arch: str) -> CompiledKernel
      compile with `cute.compile(..., options="--gpu-arch <arch> ...")` (no GPU needed) and
      return the cubin, the PTX, the entry symbol and the declared launch ABI (kernels/abi.py).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from .abi import KernelAbi

# The DSL's own file cache (/tmp/cute_dsl_python_cache_*) would be a second, unkeyed cache under
# ours: every compile that prepare asks for must really compile (reproducibility is tested that way).
# Set before any kernel module imports cutlass, which reads its environment once.
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

_HERE = Path(__file__).resolve().parent
KERNELS = ("qk_norm", "qkv_front")
# files whose bytes define what a kernel compiles to (the kernel source hash of the cache key)
_COMMON_SOURCES = ("abi.py", "_dsl.py")


@dataclass(frozen=True)
class CompiledKernel:
    symbol: str
    cubin: bytes
    ptx: str
    abi: KernelAbi


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")


def source_files(kernel: str) -> list[Path]:
    _check_kernel(kernel)
    files = [_HERE / f"{kernel}.py"] + [_HERE / n for n in _COMMON_SOURCES]
    return [f for f in files if f.exists()]


@functools.lru_cache(maxsize=None)
def source_hash(kernel: str) -> str:
    """sha256 over the kernel's source files (read as bytes: no import, works without cutlass).

    Read once per process: every key of every variant of a kernel needs it (prepare, plan recording,
    each runtime lookup), and the installed sources do not change under a running process.
    """
    h = hashlib.sha256()
    for f in source_files(kernel):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def compile_variant(variant, arch: str) -> CompiledKernel:
    """Compile `variant` for `arch` (imports cutlass: needs the `build` extra)."""
    _check_kernel(variant.kernel)
    mod = importlib.import_module(f"{__name__}.{variant.kernel}")
    return mod.compile_variant(variant, arch)
