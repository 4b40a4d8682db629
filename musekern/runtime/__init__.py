"""The runtime loader (cuda.bindings only; importing it never imports cutlass)."""
from .driver import CudaError
from .loader import (
                     ArchMismatchError,
                     LoadedKernel,
                     MissingKernelError,
                     device_arch,
                     get_kernel,
                     load_artifact,
                     loaded_kernels,
)

__all__ = ["ArchMismatchError", "CudaError", "LoadedKernel", "MissingKernelError", "device_arch", "get_kernel",
           "load_artifact", "loaded_kernels"]
