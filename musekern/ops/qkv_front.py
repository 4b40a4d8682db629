"""musekern.qkv_front: the fused decode attention front (seed 000) on the cached CuTe DSL kernel.

qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
          out=None) -> y
computes y = bf16(x @ weight^T), RMS-norms + RoPEs the q and k heads, and writes k and v into
the paged caches (see musekern.reference.qkv_front_reference, which it equals up to the GEMM's
summation order). Importing this module never imports cutlass: the kernel comes from the cache
through musekern.runtime; `compile_qkv_front` and `QkvFrontKernel` import the DSL lazily.
"""
from __future__ import annotations

import functools

import torch

from ..variants.qkv_front import HEAD_COLS, HIDDEN, MAX_TOKENS, QkvFrontVariant, launch_grid, supports_shape
from ..variants.qkv_front_rules import variant
from ._bind import binder

_ALIGN = 16  # TMA needs 16-byte aligned bases (x, weight); y is stored with 4-byte vectors from a 16B base
_INT32_MAX = 2**31 - 1


def _is_tensor(t) -> bool:
    return isinstance(t, torch.Tensor)


def hidden_rows_ok(x) -> bool:
    """x is a bf16 [M, 8192] matrix with 1 <= M <= 16, contiguous and 16-byte aligned (TMA-able)."""
    return (_is_tensor(x) and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == HIDDEN
            and 1 <= x.shape[0] <= MAX_TOKENS and x.is_contiguous() and x.data_ptr() % _ALIGN == 0)


def _cache_reason(name: str, c, num_kv_heads: int) -> str | None:
    if not _is_tensor(c):
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
    bad = any(c.shape[d] > 1 and c.stride(d) != inner[d - 1] for d in (1, 2, 3))
    if bad:
        return (f"{name}'s inner three dims must be contiguous (strides (..., {inner[0]}, {inner[1]}, 1)), "
                f"got strides {tuple(c.stride())}")
    if nb > 1 and c.stride(0) < bs * inner[0]:
        return f"{name}'s block stride {c.stride(0)} is smaller than a block ({bs * inner[0]} elements)"
    if nb * bs > _INT32_MAX:
        return f"{name} has {nb} x {bs} slots; at most {_INT32_MAX} are supported"
    if c.data_ptr() % 4:
        return f"{name} must be 4-byte aligned"
    return None


def _kv_reason(key_cache, value_cache, num_kv_heads) -> str | None:
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        r = _cache_reason(name, c, num_kv_heads)
        if r:
            return r
    if tuple(key_cache.shape) != tuple(value_cache.shape):
        return f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in shape"
    return None


def kv_cache_layout_ok(key_cache, value_cache, num_kv_heads: int) -> bool:
    """bf16 [num_blocks, block_size, num_kv_heads, 64] caches, inner three dims contiguous, any block
    stride (vLLM's split [2, blocks, ...] and FlashInfer's [blocks, 2, ...] NHD layouts), same shape."""
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        return False
    return _kv_reason(key_cache, value_cache, num_kv_heads) is None


def _layout_reason(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                   out) -> str | None:
    """Every check but the device one (so the rejections are testable with CPU tensors)."""
    for name, t in (("x", x), ("weight", weight), ("positions", positions), ("cos_sin_cache", cos_sin_cache),
                    ("slot_mapping", slot_mapping)):
        if not _is_tensor(t):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if x.dtype != torch.bfloat16:
        return f"x.dtype must be bfloat16, got {x.dtype}"
    if x.dim() != 2 or x.shape[1] != HIDDEN:
        return f"x must be [M, {HIDDEN}], got shape {tuple(x.shape)}"
    m = x.shape[0]
    if not 1 <= m <= MAX_TOKENS:
        return f"M (x.shape[0]) must be in 1..{MAX_TOKENS}, got {m}"
    if not x.is_contiguous():
        return f"x must be contiguous, got strides {tuple(x.stride())}"
    if x.data_ptr() % _ALIGN:
        return f"x must be {_ALIGN}-byte aligned (data_ptr % {_ALIGN} = {x.data_ptr() % _ALIGN})"
    if weight.dtype != torch.bfloat16:
        return f"weight.dtype must be bfloat16, got {weight.dtype}"
    if weight.dim() != 2 or weight.shape[1] != HIDDEN:
        return f"weight must be [N, {HIDDEN}], got shape {tuple(weight.shape)}"
    if not weight.is_contiguous():
        return f"weight must be row-major contiguous, got strides {tuple(weight.stride())}"
    if weight.data_ptr() % _ALIGN:
        return f"weight must be {_ALIGN}-byte aligned"
    n = weight.shape[0]
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        return f"num_kv_heads must be an int, got {num_kv_heads!r}"
    if not supports_shape(n, num_kv_heads):
        return (f"N={n} is not a q|k|v|gate layout of 64-column heads with num_kv_heads={num_kv_heads} "
                f"(needs N % 64 == 0, N/64 - 2*num_kv_heads = 2*nq > 0, nq % num_kv_heads == 0)")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dtype != torch.int64:
            return f"{name}.dtype must be int64, got {t.dtype}"
        if t.dim() != 1 or t.shape[0] != m:
            return f"{name} must be [M={m}], got shape {tuple(t.shape)}"
        if t.stride(0) != 1 and m > 1:
            return f"{name} must be contiguous, got stride {t.stride(0)}"
    if cos_sin_cache.dtype != torch.float32:
        return f"cos_sin_cache.dtype must be float32, got {cos_sin_cache.dtype}"
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != HEAD_COLS or cos_sin_cache.shape[0] < 1:
        return f"cos_sin_cache must be [max_pos >= 1, {HEAD_COLS}], got shape {tuple(cos_sin_cache.shape)}"
    if not cos_sin_cache.is_contiguous():
        return f"cos_sin_cache must be contiguous, got strides {tuple(cos_sin_cache.stride())}"
    if cos_sin_cache.shape[0] * HEAD_COLS > _INT32_MAX:
        return f"cos_sin_cache has {cos_sin_cache.shape[0]} rows; at most {_INT32_MAX // HEAD_COLS} are supported"
    r = _kv_reason(key_cache, value_cache, num_kv_heads)
    if r:
        return r
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        return f"eps must be a finite float >= 0, got {eps!r}"
    if out is not None:
        if not _is_tensor(out) or out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n):
            return f"out must be a bfloat16 tensor of shape ({m}, {n})"
        if not out.is_contiguous() or out.data_ptr() % _ALIGN:
            return f"out must be contiguous and {_ALIGN}-byte aligned"
        if _overlaps(out, x):
            return "out must not overlap x (other CTAs may still be reading x while y is stored)"
    return None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a.device == b.device and a0 < b1 and b0 < a1


_supports_shape = functools.lru_cache(maxsize=256)(supports_shape)


def _fast_ok(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
             out) -> bool:
    """The common valid call, accepted with as few tensor attribute reads as possible (issue 5: the checked
    call's host cost). Stricter than `_layout_reason` + the device checks (exact strides instead of
    "contiguous", a CUDA x, same device index everywhere): whatever it accepts, those accept; anything
    else goes through them for the reason."""
    try:
        bf = torch.bfloat16
        m = x.shape[0]
        n = weight.shape[0]
        kshape = key_cache.shape
        nkv = num_kv_heads
        if not (x.dtype is bf and weight.dtype is bf and key_cache.dtype is bf and value_cache.dtype is bf
                and positions.dtype is torch.int64 and slot_mapping.dtype is torch.int64
                and cos_sin_cache.dtype is torch.float32 and type(nkv) is int and type(eps) is float
                and 0.0 <= eps < float("inf") and 1 <= m <= MAX_TOKENS and x.is_cuda):
            return False
        dev = x.get_device()
        if not (x.stride() == (HIDDEN, 1) and x.shape[1] == HIDDEN and weight.stride() == (HIDDEN, 1)
                and weight.shape[1] == HIDDEN and _supports_shape(n, nkv)
                and (x.data_ptr() | weight.data_ptr()) % _ALIGN == 0
                and positions.shape == (m,) and slot_mapping.shape == (m,)
                and positions.stride() == (1,) and slot_mapping.stride() == (1,)
                and cos_sin_cache.stride() == (HEAD_COLS, 1) and cos_sin_cache.shape[1] == HEAD_COLS
                and 0 < cos_sin_cache.shape[0] <= _INT32_MAX // HEAD_COLS
                and len(kshape) == 4 and kshape == value_cache.shape and kshape[2] == nkv
                and kshape[3] == HEAD_COLS and kshape[0] >= 1 and kshape[1] >= 1
                and kshape[0] * kshape[1] <= _INT32_MAX
                and key_cache.stride()[1:] == (nkv * HEAD_COLS, HEAD_COLS, 1)
                and value_cache.stride()[1:] == (nkv * HEAD_COLS, HEAD_COLS, 1)
                and key_cache.stride(0) >= kshape[1] * nkv * HEAD_COLS
                and value_cache.stride(0) >= kshape[1] * nkv * HEAD_COLS
                and (key_cache.data_ptr() | value_cache.data_ptr()) % 4 == 0
                and weight.get_device() == dev and positions.get_device() == dev
                and slot_mapping.get_device() == dev and cos_sin_cache.get_device() == dev
                and key_cache.get_device() == dev and value_cache.get_device() == dev):
            return False
        if out is not None:
            return (out.dtype is bf and out.shape == (m, n) and out.stride() == (n, 1)
                    and out.data_ptr() % _ALIGN == 0 and out.get_device() == dev and not _overlaps(out, x))
        return True
    except (AttributeError, TypeError, IndexError):  # not tensors, wrong ranks: the slow path says why
        return False


def unsupported(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                out=None) -> str | None:
    """Why the qkv_front kernel cannot take this call (checked before launch), or None."""
    if _fast_ok(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                out):
        return None
    r = _layout_reason(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads,
                       eps, out)
    if r:
        return r
    named = [("x", x), ("weight", weight), ("positions", positions), ("cos_sin_cache", cos_sin_cache),
             ("slot_mapping", slot_mapping), ("key_cache", key_cache), ("value_cache", value_cache)]
    if out is not None:
        named.append(("out", out))
    if not x.is_cuda:
        return f"x must be on a CUDA device, got {x.device} (use musekern.reference for CPU tensors)"
    for name, t in named:
        if t.device != x.device:
            return f"{name} is on {t.device}, x on {x.device}: all tensors must be on one CUDA device"
    return None


# ---------------------------------------------------------------- launch
@functools.lru_cache(maxsize=None)
def _target(device_index: int):
    from ..targets import local_target

    t = local_target(device_index)
    if t is None:
        raise RuntimeError(f"qkv_front: no CUDA device {device_index} visible to the driver")
    return t


@functools.lru_cache(maxsize=None)
def _variant(n: int, m: int, num_kv_heads: int, device_index: int) -> QkvFrontVariant:
    return variant(n, m, num_kv_heads, _target(device_index))


# How each value the kernel's launch ABI (kernels/qkv_front.py::abi_for) names is computed from a call; the
# loaded kernel's param_names give the order (ops/_bind.py). Tensor-map parameters take the tensor itself.
_ARGS = "x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, eps, out"
_VALUES = {
    "weight": "weight", "x": "x", "M": "x.shape[0]", "weight_ptr": "weight.data_ptr()", "y": "out.data_ptr()",
    "positions": "positions.data_ptr()", "cos_sin_cache": "cos_sin_cache.data_ptr()",
    "slot_mapping": "slot_mapping.data_ptr()", "key_cache": "key_cache.data_ptr()",
    "value_cache": "value_cache.data_ptr()", "max_pos": "cos_sin_cache.shape[0]", "block_size": "key_cache.shape[1]",
    "num_blocks": "key_cache.shape[0]", "k_block_stride": "key_cache.stride(0)",
    "v_block_stride": "value_cache.stride(0)", "eps": "float(eps)",
}
_all_values = binder("qkv_front", tuple(_VALUES), _VALUES, _ARGS)


def launch_args(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, eps, out) -> dict:
    """Every value a qkv_front build may take, by ABI name: the `args` of LoadedKernel.launch."""
    return dict(zip(_VALUES, _all_values(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                                         eps, out), strict=True))


def launch(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
           out=None) -> torch.Tensor:
    """No checks: launch the cached variant this call takes on torch's current stream."""
    m, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    dev = x.get_device()
    kernel, grid, bind = _launch_plan(n, m, num_kv_heads, dev if dev >= 0 else torch.cuda.current_device())
    kernel.launch_ordered(grid, bind(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, eps,
                                     out))
    return out


@functools.lru_cache(maxsize=None)
def _launch_plan(n: int, m: int, num_kv_heads: int, device_index: int):
    """(loaded kernel, grid, its binder) of a call shape: resolved once per process (the host cost of `launch`)."""
    from ..runtime import get_kernel

    v = _variant(n, m, num_kv_heads, device_index)
    kernel = get_kernel(v, device=device_index)
    return kernel, launch_grid(v), binder(v.label, kernel.param_names, _VALUES, _ARGS)


def qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
              out=None) -> torch.Tensor:
    """Checked qkv_front: raises TypeError (wrong types/dtypes) or ValueError with the reason, else launches."""
    reason = unsupported(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads,
                         eps, out)
    if reason is not None:
        if "dtype" in reason or "must be a torch.Tensor" in reason or "must be an int" in reason:
            raise TypeError(f"qkv_front: {reason}")
        raise ValueError(f"qkv_front: {reason}")
    return launch(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                  out)


def qkv_front_auto(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                   out=None) -> torch.Tensor:
    """The kernel when it can take the call and a GPU is there, else the plain-torch reference."""
    if torch.cuda.is_available() and unsupported(x, weight, positions, cos_sin_cache, slot_mapping, key_cache,
                                                 value_cache, num_kv_heads, eps, out) is None:
        return launch(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads,
                      eps, out)
    from ..reference import qkv_front_reference

    return qkv_front_reference(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                               num_kv_heads, eps, out)


def _default_kv_heads(n: int) -> int:
    from ..config import load_config

    for shard in load_config().shards():
        if shard.n == n:
            return shard.num_kv_heads
    raise ValueError(f"N={n} is not a shard of the default model; pass num_kv_heads")


def prepare(N: int, rows=MAX_TOKENS, num_kv_heads: int | None = None, device=None) -> list:
    """Load every variant the calls with weight rows N and M in `rows` take (before CUDA graph capture).

    `rows`: an int (every M in 1..rows) or an iterable of M values. `num_kv_heads` defaults to the
    bundled model's shard of this N. Returns the loaded kernels (raises MissingKernelError, naming
    the `musekern prepare` command, if one is not in the cache).
    """
    from ..runtime import get_kernel

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
    seen, kernels = set(), []
    for m in ms:
        v = _variant(N, int(m), num_kv_heads, dev)
        if v not in seen:
            seen.add(v)
            kernels.append(get_kernel(v, device=dev))
    return kernels


def compile_qkv_front(v: QkvFrontVariant, arch: str):
    """Compile one variant (imports cutlass: needs the `build` extra). = kernels.qkv_front.compile_variant."""
    from ..kernels.qkv_front import compile_variant

    return compile_variant(v, arch)


def __getattr__(name):
    if name == "QkvFrontKernel":  # the CuTe DSL class, imported lazily (cutlass is a build-only dependency)
        from ..kernels.qkv_front import QkvFrontKernel

        return QkvFrontKernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["unsupported", "hidden_rows_ok", "kv_cache_layout_ok", "launch", "launch_args", "qkv_front",
           "qkv_front_auto", "prepare", "compile_qkv_front"]  # + QkvFrontKernel (lazy, module __getattr__)
