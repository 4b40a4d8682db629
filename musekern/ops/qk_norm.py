"""musekern.qk_norm: unweighted per-head RMS norm (seed 002) on the cached CuTe DSL kernel."""
from __future__ import annotations

import functools

import torch

from ..kernels.qk_norm.variant import (
    QK_NORM_MAX_VECTORS,
    QK_NORM_VEC_ELEMS,
    SUPPORTED_HEAD_DIMS,
    launch_grid,
    qk_norm_variant,
    qk_norm_vectors,
)
from . import checks
from ._bind import Plans, binder, take

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_VEC_BYTES = 16  # the kernel moves 16 bytes per thread access


def qk_norm_unsupported(x, head_dim: int, out=None) -> str | None:
    """Why qk_norm cannot take this call (checked before launch), or None."""
    if not isinstance(x, torch.Tensor):
        return f"x must be a torch.Tensor, got {type(x).__name__}"
    if x.dtype not in _DTYPES:
        return f"x.dtype must be bfloat16 or float16, got {x.dtype}"
    if x.dim() != 2:
        return f"x must be 2-D [M, heads*head_dim], got {x.dim()}-D shape {tuple(x.shape)}"
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim!r}"
    if x.shape[1] == 0 or x.shape[1] % head_dim:
        return f"x.shape[1] ({x.shape[1]}) must be a positive multiple of head_dim ({head_dim})"
    if x.shape[0] > 0 and x.stride(1) != 1:
        return f"x's last dim must be contiguous (stride 1), got stride {x.stride(1)}"
    esize = x.element_size()
    if x.shape[0] > 1 and (x.stride(0) * esize) % _VEC_BYTES:
        return f"x's row stride ({x.stride(0)} elements) must be a multiple of {_VEC_BYTES // esize} elements"
    if x.shape[0] > 1 and x.stride(0) < x.shape[1]:
        return f"x's row stride ({x.stride(0)}) is smaller than a row ({x.shape[1]}): rows overlap"
    if x.data_ptr() % _VEC_BYTES:
        return f"x must be {_VEC_BYTES}-byte aligned (data_ptr % 16 = {x.data_ptr() % _VEC_BYTES})"
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or tuple(out.shape) != tuple(x.shape):
            return f"out must be a {x.dtype} tensor of shape {tuple(x.shape)}"
        if out.device != x.device:
            return f"out is on {out.device}, x on {x.device}"
        if x.shape[0] > 0 and (out.stride(1) != 1 or (out.shape[0] > 1 and (out.stride(0) * esize) % _VEC_BYTES)
                               or out.data_ptr() % _VEC_BYTES):
            return "out must have a contiguous last dim, 16-byte aligned rows and base"
    return None


def _fast(x, head_dim, eps, scale, out):
    """The common valid call (M >= 1, float eps and scale, one CUDA device), checked reading each attribute once and
    launched with the values it read: y, or None for any other call (then `qk_norm` checks it for the reason, or
    launches it). Stricter than `qk_norm_unsupported`: whatever it accepts, that accepts."""
    try:
        name = _DTYPES.get(x.dtype)
        m, n = x.shape
        if not (name is not None and type(head_dim) is int and head_dim in SUPPORTED_HEAD_DIMS and type(eps) is float
                and type(scale) is float and m >= 1 and n > 0 and n % head_dim == 0 and x.is_cuda
                and m * n <= _MAX_ELEMS):
            return None
        sx, ux = x.stride()
        x0, dev = x.data_ptr(), x.get_device()
        # both dtypes are 2 bytes an element: a row stride of 8 elements is 16 bytes
        if ux != 1 or x0 % _VEC_BYTES or (m > 1 and (sx % 8 or sx < n)):
            return None
        if out is None:
            out = x.new_empty(m, n)  # x's dtype and device; int sizes parse faster than a tuple
            sy = n
        else:
            sy, uy = out.stride()
            if not (out.dtype is x.dtype and out.shape == (m, n) and uy == 1 and out.get_device() == dev
                    and (m == 1 or sy % 8 == 0)):
                return None
        y0 = out.data_ptr()
        if y0 % _VEC_BYTES:
            return None
    except (AttributeError, TypeError, ValueError):  # not a tensor, not 2-D: the checks say why
        return None
    heads = n // head_dim
    _PLANS[(name, head_dim, scale, m, heads, dev)]([x0, y0, m, heads, sx, sy, eps, scale])  # `_VALUES` order
    return out


def qk_norm(x: torch.Tensor, head_dim: int, eps: float = 1e-5, scale: float = 1.0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """RMS-norm each head_dim group of x [M, heads*head_dim] (rows may be strided), times scale."""
    y = _fast(x, head_dim, eps, scale, out)
    if y is not None:
        return y
    reason = qk_norm_unsupported(x, head_dim, out)
    if reason is not None:
        if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or (out is not None and (
                not isinstance(out, torch.Tensor) or out.dtype != x.dtype)):
            raise TypeError(f"qk_norm: {reason}")
        raise ValueError(f"qk_norm: {reason}")
    if not x.is_cuda:
        raise ValueError(f"qk_norm: x must be on a CUDA device, got {x.device} (use musekern.reference "
                         f"for CPU tensors)")
    m, n = x.shape
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    heads = n // head_dim
    variant = qk_norm_variant(_DTYPES[x.dtype], head_dim, float(scale), qk_norm_vectors(head_dim, m, heads))
    _launcher(variant, m, heads, x.get_device())(_all_values(x, out, m, heads, eps, scale))
    return out


# How each value of the kernel's launch ABI (kernels/qk_norm/abi.py) is computed from a call (ops/_bind.py);
# `_fast` reads the same values, in this order, while it checks them (tests/test_ops_qk_norm.py compares).
_ARGS = "x, out, m, heads, eps, scale"
_VALUES = {"x": "x.data_ptr()", "out": "out.data_ptr()", "m": "m", "heads": "heads", "ld_x": "x.stride(0)",
           "ld_out": "out.stride(0)", "eps": "float(eps)", "scale": "float(scale)"}
_NAMES = tuple(_VALUES)
_all_values = binder("qk_norm", _NAMES, _VALUES, _ARGS)
_MAX_ELEMS = QK_NORM_MAX_VECTORS * QK_NORM_VEC_ELEMS  # larger inputs: launch_grid says why


@functools.lru_cache(maxsize=None)
def _loaded(variant, device_index: int):
    """(loaded kernel, the index of each of its parameters among `_VALUES`), once per variant and device."""
    from ..runtime import get_kernel

    kernel = get_kernel(variant, device=device_index, on_miss=checks.on_miss())
    return kernel, take(variant.label, kernel.param_names, _NAMES)


@functools.lru_cache(maxsize=1024)
def _launcher(variant, m: int, heads: int, device_index: int):
    """The launcher of `variant` for an [m, heads * head_dim] call (its grid), taking `_VALUES`-ordered values."""
    kernel, order = _loaded(variant, device_index)
    return kernel.launcher(launch_grid(variant, m, heads), take=order)


def _resolve(dtype: str, head_dim: int, scale: float, m: int, heads: int, device_index: int):
    v = qk_norm_variant(dtype, head_dim, scale, qk_norm_vectors(head_dim, m, heads))
    return _launcher(v, m, heads, device_index)


_PLANS = Plans(_resolve)  # (dtype, head_dim, scale, M, heads, device) -> the launcher of the call's build


def prepare(head_dim: int, dtype=torch.bfloat16, device=None) -> list:
    """Load every qk_norm build of this head size and dtype (with and without a scale, for small and large inputs)
    before a CUDA graph is captured; returns them (MissingKernelError names the `musekern prepare` command)."""
    from ..kernels.qk_norm.variant import qk_norm_variants

    dev = checks.device_index(device)
    return [_loaded(v, dev)[0] for v in qk_norm_variants(_DTYPES[dtype], head_dim)]
