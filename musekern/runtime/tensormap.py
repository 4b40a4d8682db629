"""CUtensorMap encoding with cuTensorMapEncodeTiled, from a manifest's TensorMapSpec.

CuTe DSL writes its descriptors bit by bit in its own host code (NOTES.md §5); a loader
without cutlass asks the driver instead. Verified byte-identical to a direct libcuda call
on an H200 (shared/cute-dsl/e2e-tma-cluster).
"""
from __future__ import annotations

import ctypes
import threading

from cuda.bindings import driver as drv

from ..store.abi import TensorMapSpec
from .driver import check

_DTYPES = {
    "bf16": (drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2),
    "f16": (drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2),
    "f32": (drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
    "u8": (drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),  # e4m3 bytes
}
_SWIZZLE = {"none": "CU_TENSOR_MAP_SWIZZLE_NONE", "32B": "CU_TENSOR_MAP_SWIZZLE_32B",
            "64B": "CU_TENSOR_MAP_SWIZZLE_64B", "128B": "CU_TENSOR_MAP_SWIZZLE_128B"}
_L2 = {"none": "CU_TENSOR_MAP_L2_PROMOTION_NONE", "64B": "CU_TENSOR_MAP_L2_PROMOTION_L2_64B",
       "128B": "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", "256B": "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"}
_OOB = {"none": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE", "nan": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA"}
_INTERLEAVE = {"none": "CU_TENSOR_MAP_INTERLEAVE_NONE"}
TENSORMAP_BYTES = 128


def encode_2d(spec: TensorMapSpec, ptr: int, rows: int, cols: int, row_stride_elems: int, kernel: str) -> bytes:
    """128 bytes of a CUtensorMap over a row-major [rows, cols] matrix at device address `ptr`."""
    dtype, esize = _DTYPES[spec.dtype]
    gdim = [drv.cuuint64_t(cols), drv.cuuint64_t(rows)]
    gstride = [drv.cuuint64_t(row_stride_elems * esize)]  # dims above the innermost, in bytes
    box = [drv.cuuint32_t(b) for b in spec.box]
    estr = [drv.cuuint32_t(1), drv.cuuint32_t(1)]
    tm = check(drv.cuTensorMapEncodeTiled(
        dtype, 2, ptr, gdim, gstride, box, estr,
        getattr(drv.CUtensorMapInterleave, _INTERLEAVE[spec.interleave]),
        getattr(drv.CUtensorMapSwizzle, _SWIZZLE[spec.swizzle]),
        getattr(drv.CUtensorMapL2promotion, _L2[spec.l2_promotion]),
        getattr(drv.CUtensorMapFloatOOBfill, _OOB[spec.oob_fill])),
        f"cuTensorMapEncodeTiled({spec.tensor}: [{rows}, {cols}], box {tuple(spec.box)})", kernel)
    return ctypes.string_at(tm.getPtr(), TENSORMAP_BYTES)


class TensorMaps:
    """The encoded maps of one tensor-map parameter of a loaded kernel, per (ptr, rows, cols, row_stride_elems):
    each weight and activation buffer is encoded once (decode loops and CUDA-graph engines reuse their buffers).

    A launch passes the value of the parameter as that key tuple (the op's checked path has the numbers already)
    or as the 2-D row-major tensor (its key is read and checked here). The hot path is `maps.get(key)`, one dict
    lookup, then `encode(value)` on a miss. Bounded: past `max_entries` the oldest map goes, so a serving engine
    that feeds new activation buffers cannot grow it forever.
    """

    def __init__(self, spec: TensorMapSpec, kernel: str, max_entries: int = 4096):
        self.spec = spec
        self._kernel = kernel
        self._max = max_entries
        self.maps: dict = {}
        self._lock = threading.Lock()

    def encode(self, value) -> bytes:
        """The 128 bytes of the map `value` (a key tuple or a tensor) describes: cached, else encoded and kept."""
        if type(value) is tuple:
            key = value
        else:  # a tensor: three reads for the key; its layout is checked here, before any lookup
            shape, stride = value.shape, value.stride()
            if len(shape) != 2 or stride[1] != 1:
                raise ValueError(f"{self._kernel}: tensor map for {self.spec.tensor!r} needs a 2-D row-major tensor, "
                                 f"got shape {tuple(shape)} stride {tuple(stride)}")
            key = (value.data_ptr(), shape[0], shape[1], stride[0])
        raw = self.maps.get(key)
        if raw is None:
            ptr, rows, cols, row_stride = key
            raw = encode_2d(self.spec, ptr, rows, cols, row_stride, self._kernel)
            with self._lock:  # eviction walks the dict: one writer at a time
                while len(self.maps) >= self._max:
                    del self.maps[next(iter(self.maps))]
                self.maps[key] = raw
        return raw
