"""Thin, checked access to the CUDA driver through cuda.bindings (never cutlass)."""
from __future__ import annotations

import ctypes
import functools

from cuda.bindings import driver as drv

from .. import env

OK = drv.CUresult.CUDA_SUCCESS


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the kernel and the call."""

    def __init__(self, what: str, err, kernel: str | None = None):
        self.err = err
        where = f"{kernel}: " if kernel else ""
        super().__init__(f"{where}{what} failed: {error_string(err)}")


def error_string(err) -> str:
    try:
        name = drv.cuGetErrorName(err)[1].decode()
        desc = drv.cuGetErrorString(err)[1].decode()
        return f"{name} ({desc})"
    except Exception:  # an unknown code
        return repr(err)


def check(res, what: str, kernel: str | None = None):
    """Check a cuda.bindings result `(CUresult, *outs)` (or a bare CUresult); return the outputs."""
    if isinstance(res, tuple):
        err, outs = res[0], res[1:]
    else:
        err, outs = res, ()
    if err != OK:
        raise CudaError(what, err, kernel)
    if not outs:
        return None
    return outs[0] if len(outs) == 1 else outs


@functools.lru_cache(maxsize=None)
def init() -> None:
    try:
        res = drv.cuInit(0)
    except Exception as e:  # cuda.bindings >= 13.5 raises when libcuda.so cannot be found
        raise RuntimeError(f"the CUDA driver (libcuda) cannot be loaded: {e}; musekern's runtime needs an "
                           f"NVIDIA GPU and driver (building kernels does not: `musekern prepare --target h200`)"
                           ) from None
    check(res, "cuInit")


def ensure_context(device_index: int) -> None:
    """Make the device's primary context current on this thread (the one torch uses)."""
    init()
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    dev = check(drv.cuDeviceGet(device_index), "cuDeviceGet")
    if ctx is not None and int(ctx) != 0:
        cur = check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
        if int(cur) == int(dev):
            return
    pctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(drv.cuCtxSetCurrent(pctx), "cuCtxSetCurrent")


@functools.lru_cache(maxsize=None)
def device_info(device_index: int) -> dict:
    init()
    dev = check(drv.cuDeviceGet(device_index), "cuDeviceGet")
    A = drv.CUdevice_attribute
    get = lambda a: check(drv.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute")  # noqa: E731
    return {
        "name": check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0", 1)[0].decode(),
        "capability": (get(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                       get(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
        "sm_count": get(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        "smem_optin": get(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        "l2_bytes": get(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        "driver_version": check(drv.cuDriverGetVersion(), "cuDriverGetVersion"),
    }


@functools.lru_cache(maxsize=None)
def c_launch_kernel_ex():
    """libcuda's cuLaunchKernelEx as a ctypes function, or None (then cuda.bindings' wrapper launches).

    Called with the C address of a cached CUlaunchConfig (`CUlaunchConfig.getPtr()`), the CUfunction
    handle and the kernelParams address, it skips the wrapper's per-call argument conversion: the host
    cost of an eager `launch` (issue 5: <= 10 us) is almost all Python. Same driver, same context, same
    stream semantics as the wrapper (the legacy default stream for handle 0).
    """
    if not env.flag(env.CTYPES_LAUNCH):  # MUSEKERN_CTYPES_LAUNCH=0: cuda.bindings' wrapper launches
        return None
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):  # no Linux driver library by that name, or a pre-12.0 driver
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def launch_config(grid: tuple, block: tuple, smem: int, stream: int, cluster: tuple = (1, 1, 1),
                  pdl: bool = False):
    """A CUlaunchConfig for cuLaunchKernelEx with the cluster and PDL attributes this launch needs.

    The cluster shape and PDL are not recorded in a cubin (shared/cute-dsl/NOTES.md §4): without
    the cluster attribute a cluster kernel runs as 1-CTA clusters (wrong or faulting), so every
    launch goes through here.
    """
    attrs = []
    if tuple(cluster) != (1, 1, 1):
        a = drv.CUlaunchAttribute()
        a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
        attrs.append(a)
    if pdl:
        a = drv.CUlaunchAttribute()
        a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        attrs.append(a)
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.hStream = drv.CUstream(stream)
    cfg.attrs = attrs  # copied into the config: attribute values must be set before this line
    cfg.numAttrs = len(attrs)
    return cfg
