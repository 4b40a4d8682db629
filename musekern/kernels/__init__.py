"""CuTe DSL kernel sources. Importing this package does NOT import cutlass: each kernel
module is imported lazily by `compile_variant`, only on machines that build kernels
(only `musekern.build` imports this package).

Contract for a kernel module `musekern/kernels/<name>.py`:
  abi_for(variant) -> KernelAbi
      the kernel's one launch ABI (musekern/store/abi.py), pure: the build checks it against the
      PTX `.entry` and writes it into the manifest; the runtime binds launch values by its names.
  compile_variant(variant, arch: str) -> CompiledKernel
      compile with `cute.compile(..., options="--gpu-arch <arch> ...")` (no GPU needed) and
      return the cubin, the PTX, the entry symbol and the declared launch ABI.
Its files are listed in musekern/store/keys.py::KERNEL_SOURCES (they make the key's source hash).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from ..store.abi import KernelAbi
from ..store.keys import check_kernel

# The DSL's own file cache (/tmp/cute_dsl_python_cache_*) would be a second, unkeyed cache under
# ours: every compile that prepare asks for must really compile (reproducibility is tested that way).
# Set before any kernel module imports cutlass, which reads its environment once.
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")


@dataclass(frozen=True)
class CompiledKernel:
    symbol: str
    cubin: bytes
    ptx: str
    abi: KernelAbi


def compile_variant(variant, arch: str) -> CompiledKernel:
    """Compile `variant` for `arch` (imports cutlass: needs the `build` extra)."""
    check_kernel(variant.kernel)
    mod = importlib.import_module(f"{__name__}.{variant.kernel}")
    return mod.compile_variant(variant, arch)
