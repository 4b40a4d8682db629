"""The checks the attention front's ops share (ops/qkv_front.py, ops/qkv_epilogue.py): one rule per input.

Each `*_reason` returns one line saying what is wrong with a call, or None; they read shapes, strides, dtypes and
addresses only (no host sync, CPU tensors work: the rejections are testable anywhere). `fast_tokens_and_caches`
is the same rules for the common valid call, with as few attribute reads as possible (the checked call's host
cost): whatever it accepts, the reasons accept.
"""
from __future__ import annotations

import torch

HEAD_COLS = 64  # columns per head: the caches' last dim, the cos|sin row width
ALIGN = 16  # TMA bases and 16-byte vector loads / stores
VEC = 8  # bf16 elements per 16 bytes: the caches' block strides are multiples of it
INT32_MAX = 2**31 - 1


def is_tensor(t) -> bool:
    return isinstance(t, torch.Tensor)


def span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a tensor with non-negative strides can touch."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def meets_cache(a0: int, a1: int, c: torch.Tensor) -> bool:
    """Does the byte range [a0, a1) meet cache `c` (a layout `kv_reason` accepts: bf16, the inner three dims
    contiguous)? The fast paths' overlap test: a few reads, where `overlaps` walks every dim."""
    c0, s = c.data_ptr(), c.shape
    c1 = c0 + ((s[0] - 1) * c.stride(0) + s[1] * s[2] * s[3]) * 2
    return a0 < c1 and c0 < a1


def num_kv_heads_reason(num_kv_heads) -> str | None:
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        return f"num_kv_heads must be an int, got {num_kv_heads!r}"
    return None


def layout_reason(n: int, num_kv_heads: int, supports_shape, where: str) -> str | None:
    """N (`where` says which dim it is) is a q|k|v|gate row of 64-column heads for num_kv_heads."""
    if not supports_shape(n, num_kv_heads):
        return (f"N={n} ({where}) is not a q|k|v|gate layout of {HEAD_COLS}-column heads with "
                f"num_kv_heads={num_kv_heads} "
                f"(needs N % 64 == 0, N/64 - 2*num_kv_heads = 2*nq > 0, nq % num_kv_heads == 0)")
    return None


def eps_reason(eps) -> str | None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        return f"eps must be a finite float >= 0, got {eps!r}"
    return None


def token_inputs_reason(m: int, positions, slot_mapping, cos_sin_cache) -> str | None:
    """positions and slot_mapping int64 [M] contiguous; cos_sin_cache float32 [max_pos >= 1, 64] contiguous and
    16-byte aligned (the kernels read its rows with 16-byte loads)."""
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping), ("cos_sin_cache", cos_sin_cache)):
        if not is_tensor(t):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dtype != torch.int64:
            return f"{name}.dtype must be int64, got {t.dtype}"
        if t.dim() != 1 or t.shape[0] != m:
            return f"{name} must be [M={m}], got shape {tuple(t.shape)}"
        if t.stride(0) != 1 and m > 1:
            return f"{name} must be contiguous, got stride {t.stride(0)}"
    c = cos_sin_cache
    if c.dtype != torch.float32:
        return f"cos_sin_cache.dtype must be float32, got {c.dtype}"
    if c.dim() != 2 or c.shape[1] != HEAD_COLS or c.shape[0] < 1:
        return f"cos_sin_cache must be [max_pos >= 1, {HEAD_COLS}], got shape {tuple(c.shape)}"
    if not c.is_contiguous():
        return f"cos_sin_cache must be contiguous, got strides {tuple(c.stride())}"
    if c.shape[0] * HEAD_COLS > INT32_MAX:
        return f"cos_sin_cache has {c.shape[0]} rows; at most {INT32_MAX // HEAD_COLS} are supported"
    if c.data_ptr() % ALIGN:
        return f"cos_sin_cache must be {ALIGN}-byte aligned (data_ptr % {ALIGN} = {c.data_ptr() % ALIGN})"
    return None


def _cache_reason(name: str, c, num_kv_heads: int) -> str | None:
    if not is_tensor(c):
        return f"{name} must be a torch.Tensor, got {type(c).__name__}"
    if c.dtype != torch.bfloat16:
        return f"{name}.dtype must be bfloat16, got {c.dtype}"
    if c.dim() != 4 or c.shape[2] != num_kv_heads or c.shape[3] != HEAD_COLS:
        return (f"{name} must be [num_blocks, block_size, num_kv_heads={num_kv_heads}, {HEAD_COLS}], "
                f"got shape {tuple(c.shape)}")
    nb, bs = c.shape[0], c.shape[1]
    if nb < 1 or bs < 1:
        return f"{name} must have at least one block of one slot, got shape {tuple(c.shape)}"
    inner = (num_kv_heads * HEAD_COLS, HEAD_COLS, 1)
    # strides of size-1 dims are meaningless in torch (any value addresses the same elements)
    if any(c.shape[d] > 1 and c.stride(d) != inner[d - 1] for d in (1, 2, 3)):
        return (f"{name}'s inner three dims must be contiguous (strides (..., {inner[0]}, {inner[1]}, 1)), "
                f"got strides {tuple(c.stride())}")
    if nb > 1 and c.stride(0) < bs * inner[0]:
        return f"{name}'s block stride {c.stride(0)} is smaller than a block ({bs * inner[0]} elements)"
    if nb > 1 and c.stride(0) % VEC:
        return f"{name}'s block stride ({c.stride(0)} elements) must be a multiple of {VEC}"
    if nb * bs > INT32_MAX:
        return f"{name} has {nb} x {bs} slots; at most {INT32_MAX} are supported"
    if bs * inner[0] > INT32_MAX:
        return f"a block of {name} ({bs} slots x {num_kv_heads} heads x {HEAD_COLS}) must be < 2^31 elements"
    if c.data_ptr() % ALIGN:
        return f"{name} must be {ALIGN}-byte aligned (data_ptr % {ALIGN} = {c.data_ptr() % ALIGN})"
    return None


def kv_reason(key_cache, value_cache, num_kv_heads: int) -> str | None:
    """bf16 [num_blocks, block_size, num_kv_heads, 64] caches, inner three dims contiguous, any block stride that is
    a multiple of 8 elements (vLLM's split [2, blocks, ...] and FlashInfer's [blocks, 2, ...] NHD layouts), 16-byte
    aligned, the same shape."""
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        r = _cache_reason(name, c, num_kv_heads)
        if r:
            return r
    if tuple(key_cache.shape) != tuple(value_cache.shape):
        return f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in shape"
    return None


def device_reason(lead: str, t0: torch.Tensor, named) -> str | None:
    """Every tensor on `t0`'s CUDA device."""
    if not t0.is_cuda:
        return f"{lead} must be on a CUDA device, got {t0.device} (use musekern.reference for CPU tensors)"
    for name, t in named:
        if t.device != t0.device:
            return f"{name} is on {t.device}, {lead} on {t0.device}: all tensors must be on one CUDA device"
    return None


def fast_tokens_and_caches(m: int, dev: int, positions, slot_mapping, cos_sin_cache, key_cache, value_cache,
                           nkv: int) -> bool:
    """`token_inputs_reason` and `kv_reason` of the common valid call, and every tensor on device `dev`, in few
    attribute reads (the caller has already checked dtypes and that nkv is an int)."""
    kshape = key_cache.shape
    inner = (nkv * HEAD_COLS, HEAD_COLS, 1)
    ks, vs = key_cache.stride(), value_cache.stride()
    return (positions.shape == (m,) and slot_mapping.shape == (m,)
            and positions.stride() == (1,) and slot_mapping.stride() == (1,)
            and cos_sin_cache.stride() == (HEAD_COLS, 1) and cos_sin_cache.shape[1] == HEAD_COLS
            and 0 < cos_sin_cache.shape[0] <= INT32_MAX // HEAD_COLS
            and len(kshape) == 4 and kshape == value_cache.shape and kshape[2] == nkv
            and kshape[3] == HEAD_COLS and kshape[0] >= 1 and kshape[1] >= 1
            and kshape[0] * kshape[1] <= INT32_MAX and kshape[1] * inner[0] <= INT32_MAX
            and ks[1:] == inner and vs[1:] == inner and ks[0] >= kshape[1] * inner[0] and vs[0] >= kshape[1] * inner[0]
            and (ks[0] | vs[0]) % VEC == 0
            and (cos_sin_cache.data_ptr() | key_cache.data_ptr() | value_cache.data_ptr()) % ALIGN == 0
            and positions.get_device() == dev and slot_mapping.get_device() == dev
            and cos_sin_cache.get_device() == dev and key_cache.get_device() == dev
            and value_cache.get_device() == dev)


def raise_for(op: str, reason: str):
    """The checked calls' one exception rule: TypeError for a wrong type or dtype, else ValueError."""
    if "dtype" in reason or "must be a torch.Tensor" in reason or "must be an int" in reason:
        raise TypeError(f"{op}: {reason}")
    raise ValueError(f"{op}: {reason}")
