"""musekern.qkv_epilogue: the attention front's epilogue on a GEMM result (any M), on the cached CuTe DSL kernel.

qkv_epilogue(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> y
takes y = bf16(x @ W^T) [M, N] (q | k | v | gate, 64 columns a head, e.g. from torch.mm), RMS-norms and RoPEs
its q and k heads IN PLACE and writes k and v into the paged caches: musekern.reference.
fused_qknorm_rope_kv_insert, without its copy of y. No host sync, no allocation, capturable in a CUDA graph
(`prepare` loads the builds first). Importing this module never imports cutlass.
"""
from __future__ import annotations

import functools

import torch

from ..variants.qkv_epilogue import (
    EPI_HEAD_DIM,
    QkvEpilogueVariant,
    epilogue_variant,
    launch_grid,
    max_rows,
)
from ..variants.qkv_front import supports_shape
from .qkv_front import _INT32_MAX, _is_tensor, _kv_reason

_ALIGN = 16  # 16-byte loads and stores of y, cos|sin and the caches
_VEC = 8  # bf16 elements per 16 bytes: row and block strides must be multiples of it


def _span(c: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a strided tensor can touch (non-negative strides)."""
    if c.numel() == 0:
        return c.data_ptr(), c.data_ptr()
    last = sum((s - 1) * st for s, st in zip(c.shape, c.stride(), strict=True))
    return c.data_ptr(), c.data_ptr() + (last + 1) * c.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def _token_inputs_reason(m: int, positions, slot_mapping, cos_sin_cache) -> str | None:
    """The per-token inputs, as ops/qkv_front.py checks them (the same rules: one shared check at merge)."""
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dtype != torch.int64:
            return f"{name}.dtype must be int64, got {t.dtype}"
        if t.dim() != 1 or t.shape[0] != m:
            return f"{name} must be [M={m}], got shape {tuple(t.shape)}"
        if t.stride(0) != 1 and m > 1:
            return f"{name} must be contiguous, got stride {t.stride(0)}"
    if cos_sin_cache.dtype != torch.float32:
        return f"cos_sin_cache.dtype must be float32, got {cos_sin_cache.dtype}"
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != EPI_HEAD_DIM or cos_sin_cache.shape[0] < 1:
        return f"cos_sin_cache must be [max_pos >= 1, {EPI_HEAD_DIM}], got shape {tuple(cos_sin_cache.shape)}"
    if not cos_sin_cache.is_contiguous():
        return f"cos_sin_cache must be contiguous, got strides {tuple(cos_sin_cache.stride())}"
    if cos_sin_cache.shape[0] * EPI_HEAD_DIM > _INT32_MAX:
        return (f"cos_sin_cache has {cos_sin_cache.shape[0]} rows; at most {_INT32_MAX // EPI_HEAD_DIM} are "
                "supported")
    return None


def _layout_reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> str | None:
    """Every check but the device one (so the rejections are testable with CPU tensors)."""
    for name, t in (("y", y), ("positions", positions), ("cos_sin_cache", cos_sin_cache),
                    ("slot_mapping", slot_mapping)):
        if not _is_tensor(t):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if y.dtype != torch.bfloat16:
        return f"y.dtype must be bfloat16, got {y.dtype}"
    if y.dim() != 2:
        return f"y must be 2-D [M, N], got shape {tuple(y.shape)}"
    m, n = y.shape
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        return f"num_kv_heads must be an int, got {num_kv_heads!r}"
    if not supports_shape(n, num_kv_heads):
        return (f"N={n} (y.shape[1]) is not a q|k|v|gate layout of {EPI_HEAD_DIM}-column heads with num_kv_heads="
                f"{num_kv_heads} (needs N % 64 == 0, N/64 - 2*num_kv_heads = 2*nq > 0, nq % num_kv_heads == 0)")
    limit = max_rows(epilogue_variant(n, m, num_kv_heads), n, num_kv_heads)
    if m > limit:
        return f"M={m} rows of N={n} exceed one launch's {limit} (Int32 thread index); split the call"
    if m > 0:
        if y.stride(1) != 1:
            return f"y's last dim must be contiguous (stride 1), got strides {tuple(y.stride())}"
        if m > 1 and (y.stride(0) % _VEC or y.stride(0) < n or y.stride(0) > _INT32_MAX):
            return f"y's row stride ({y.stride(0)}) must be a multiple of {_VEC} elements, >= N={n} and < 2^31"
        if y.data_ptr() % _ALIGN:
            return f"y must be {_ALIGN}-byte aligned (data_ptr % {_ALIGN} = {y.data_ptr() % _ALIGN})"
    r = _token_inputs_reason(m, positions, slot_mapping, cos_sin_cache)
    if r:
        return r
    if cos_sin_cache.data_ptr() % _ALIGN:
        return f"cos_sin_cache must be {_ALIGN}-byte aligned (data_ptr % 16 = {cos_sin_cache.data_ptr() % _ALIGN})"
    r = _kv_reason(key_cache, value_cache, num_kv_heads)
    if r:
        return r
    if key_cache.shape[1] * num_kv_heads * EPI_HEAD_DIM > _INT32_MAX:
        return f"a cache block of {key_cache.shape[1]} slots x {num_kv_heads} heads must be < 2^31 elements"
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.data_ptr() % _ALIGN:
            return f"{name} must be {_ALIGN}-byte aligned (data_ptr % {_ALIGN} = {c.data_ptr() % _ALIGN})"
        if c.shape[0] > 1 and c.stride(0) % _VEC:
            return f"{name}'s block stride ({c.stride(0)} elements) must be a multiple of {_VEC}"
        if m > 0 and _overlap(y, c):
            return f"y overlaps {name} (y is rewritten in place while the caches are written)"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        return f"eps must be a finite float >= 0, got {eps!r}"
    return None


_supports_shape = functools.lru_cache(maxsize=256)(supports_shape)


@functools.lru_cache(maxsize=256)
def _rows_any_build(n: int, num_kv_heads: int) -> int:
    """The M every build takes for this N (the one-vector build's limit is the lowest)."""
    return max_rows(QkvEpilogueVariant(1), n, num_kv_heads)


def _fast_ok(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> bool:
    """The common valid call (contiguous y of M >= 1 on one CUDA device), accepted with few attribute reads.
    Stricter than `_layout_reason` + the device check: whatever it accepts, they accept; anything else goes
    through them for the reason."""
    try:
        bf = torch.bfloat16
        m, n = y.shape
        kshape = key_cache.shape
        nkv = num_kv_heads
        if not (y.dtype is bf and key_cache.dtype is bf and value_cache.dtype is bf
                and positions.dtype is torch.int64 and slot_mapping.dtype is torch.int64
                and cos_sin_cache.dtype is torch.float32 and type(nkv) is int and type(eps) is float
                and 0.0 <= eps < float("inf") and m >= 1 and y.is_cuda and _supports_shape(n, nkv)):
            return False
        dev = y.get_device()
        inner = (nkv * EPI_HEAD_DIM, EPI_HEAD_DIM, 1)
        return (y.stride() == (n, 1) and m <= _rows_any_build(n, nkv)
                and (y.data_ptr() | cos_sin_cache.data_ptr() | key_cache.data_ptr() | value_cache.data_ptr())
                % _ALIGN == 0
                and positions.shape == (m,) and slot_mapping.shape == (m,)
                and positions.stride() == (1,) and slot_mapping.stride() == (1,)
                and cos_sin_cache.stride() == (EPI_HEAD_DIM, 1) and cos_sin_cache.shape[1] == EPI_HEAD_DIM
                and 0 < cos_sin_cache.shape[0] <= _INT32_MAX // EPI_HEAD_DIM
                and len(kshape) == 4 and kshape == value_cache.shape and kshape[2] == nkv
                and kshape[3] == EPI_HEAD_DIM and kshape[0] >= 1 and kshape[1] >= 1
                and kshape[0] * kshape[1] <= _INT32_MAX and kshape[1] * nkv * EPI_HEAD_DIM <= _INT32_MAX
                and key_cache.stride()[1:] == inner and value_cache.stride()[1:] == inner
                and key_cache.stride(0) >= kshape[1] * inner[0] and value_cache.stride(0) >= kshape[1] * inner[0]
                and (key_cache.stride(0) | value_cache.stride(0)) % _VEC == 0
                and not _overlap(y, key_cache) and not _overlap(y, value_cache)
                and positions.get_device() == dev and slot_mapping.get_device() == dev
                and cos_sin_cache.get_device() == dev and key_cache.get_device() == dev
                and value_cache.get_device() == dev)
    except (AttributeError, TypeError, ValueError, IndexError):  # not tensors, wrong ranks: the slow path says why
        return False


def unsupported(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> str | None:
    """Why the qkv_epilogue kernel cannot take this call (checked before launch), or None."""
    if _fast_ok(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps):
        return None
    r = _layout_reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps)
    if r:
        return r
    if not y.is_cuda:
        return f"y must be on a CUDA device, got {y.device} (use musekern.reference for CPU tensors)"
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache), ("slot_mapping", slot_mapping),
                    ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.device != y.device:
            return f"{name} is on {t.device}, y on {y.device}: all tensors must be on one CUDA device"
    return None


# ---------------------------------------------------------------- launch
def launch_args(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> dict:
    """The values of every ABI field by name (kernels/qkv_epilogue.py::abi_for); LoadedKernel.launch packs them."""
    m, n = y.shape
    kshape = key_cache.shape  # [num_blocks, block_size, nkv, 64]
    return {"y": y.data_ptr(), "positions": positions.data_ptr(), "cos_sin_cache": cos_sin_cache.data_ptr(),
            "slot_mapping": slot_mapping.data_ptr(), "key_cache": key_cache.data_ptr(),
            "value_cache": value_cache.data_ptr(), "M": m, "num_q_heads": (n // EPI_HEAD_DIM - 2 * num_kv_heads) // 2,
            "num_kv_heads": num_kv_heads, "ld_y": y.stride(0) if m > 1 else n, "max_pos": cos_sin_cache.shape[0],
            "block_size": kshape[1], "num_blocks": kshape[0], "k_block_stride": key_cache.stride(0),
            "v_block_stride": value_cache.stride(0), "eps": float(eps)}


@functools.lru_cache(maxsize=None)
def _kernel(v: QkvEpilogueVariant, device_index: int):
    """The loaded kernel of a build on a device (once per process)."""
    from ..runtime import get_kernel

    return get_kernel(v, device=device_index)


def _device_index(t: torch.Tensor) -> int:
    dev = t.get_device()
    return dev if dev >= 0 else torch.cuda.current_device()


def launch(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
           variant: QkvEpilogueVariant | None = None) -> torch.Tensor:
    """No checks: launch the build this call takes (or `variant`) on torch's current stream; y is rewritten in
    place and returned. M == 0 launches nothing."""
    m, n = y.shape
    if m == 0:
        return y
    v = variant or epilogue_variant(n, m, num_kv_heads)
    _kernel(v, _device_index(y)).launch(launch_grid(v, m, n, num_kv_heads), launch_args(
        y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps))
    return y


def qkv_epilogue(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> torch.Tensor:
    """Checked qkv_epilogue (in place on y, which it returns): raises TypeError (wrong types / dtypes) or
    ValueError with the reason, else launches."""
    reason = unsupported(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps)
    if reason is not None:
        if "dtype" in reason or "must be a torch.Tensor" in reason or "must be an int" in reason:
            raise TypeError(f"qkv_epilogue: {reason}")
        raise ValueError(f"qkv_epilogue: {reason}")
    return launch(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps)


def _default_kv_heads(n: int) -> int:
    from ..config import load_config

    for shard in load_config().shards():
        if shard.n == n:
            return shard.num_kv_heads
    raise ValueError(f"N={n} is not a shard of the default model; pass num_kv_heads")


def prepare(N: int, rows, num_kv_heads: int | None = None, device=None) -> list:
    """Load every build the calls with N columns and M in `rows` take (before CUDA graph capture).

    `rows`: an int (every M in 1..rows) or an iterable of M values. `num_kv_heads` defaults to the bundled
    model's shard of this N. Returns the loaded kernels (raises MissingKernelError, naming the `musekern
    prepare` command, if one is not in the cache).
    """
    if num_kv_heads is None:
        num_kv_heads = _default_kv_heads(N)
    ms = range(1, rows + 1) if isinstance(rows, int) else rows
    if device is None:
        dev = torch.cuda.current_device()
    elif isinstance(device, int):
        dev = device
    else:
        idx = torch.device(device).index
        dev = idx if idx is not None else torch.cuda.current_device()
    builds = dict.fromkeys(epilogue_variant(N, int(m), num_kv_heads) for m in ms if int(m) > 0)
    return [_kernel(v, dev) for v in builds]


__all__ = ["unsupported", "launch", "launch_args", "qkv_epilogue", "prepare"]
