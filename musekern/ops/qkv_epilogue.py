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
from . import checks
from ._bind import binder
from .checks import ALIGN, INT32_MAX, VEC, is_tensor, overlaps


@functools.lru_cache(maxsize=256)
def rows_any_build(n: int, num_kv_heads: int) -> int:
    """The largest M every build takes for this N in one launch (the one-vector build's limit is the lowest)."""
    return max_rows(QkvEpilogueVariant(1), n, num_kv_heads)


def _layout_reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> str | None:
    """Every check but the device one (so the rejections are testable with CPU tensors)."""
    if not is_tensor(y):
        return f"y must be a torch.Tensor, got {type(y).__name__}"
    if y.dtype != torch.bfloat16:
        return f"y.dtype must be bfloat16, got {y.dtype}"
    if y.dim() != 2:
        return f"y must be 2-D [M, N], got shape {tuple(y.shape)}"
    m, n = y.shape
    r = checks.num_kv_heads_reason(num_kv_heads) or checks.layout_reason(n, num_kv_heads, supports_shape, "y.shape[1]")
    if r:
        return r
    limit = max_rows(epilogue_variant(n, m, num_kv_heads), n, num_kv_heads)
    if m > limit:
        return f"M={m} rows of N={n} exceed one launch's {limit} (Int32 thread index); split the call"
    if m > 0:
        if y.stride(1) != 1:
            return f"y's last dim must be contiguous (stride 1), got strides {tuple(y.stride())}"
        if m > 1 and (y.stride(0) % VEC or y.stride(0) < n or y.stride(0) > INT32_MAX):
            return f"y's row stride ({y.stride(0)}) must be a multiple of {VEC} elements, >= N={n} and < 2^31"
        if y.data_ptr() % ALIGN:
            return f"y must be {ALIGN}-byte aligned (data_ptr % {ALIGN} = {y.data_ptr() % ALIGN})"
    r = (checks.token_inputs_reason(m, positions, slot_mapping, cos_sin_cache)
         or checks.kv_reason(key_cache, value_cache, num_kv_heads))
    if r:
        return r
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if m > 0 and overlaps(y, c):
            return f"y overlaps {name} (y is rewritten in place while the caches are written)"
    return checks.eps_reason(eps)


_supports_shape = functools.lru_cache(maxsize=256)(supports_shape)


def _fast_ok(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> bool:
    """The common valid call (contiguous y of M >= 1 on one CUDA device), accepted with few attribute reads.
    Stricter than `_layout_reason` + the device check: whatever it accepts, they accept; anything else goes
    through them for the reason."""
    try:
        bf = torch.bfloat16
        m, n = y.shape
        nkv = num_kv_heads
        if not (y.dtype is bf and key_cache.dtype is bf and value_cache.dtype is bf
                and positions.dtype is torch.int64 and slot_mapping.dtype is torch.int64
                and cos_sin_cache.dtype is torch.float32 and type(nkv) is int and type(eps) is float
                and 0.0 <= eps < float("inf") and m >= 1 and y.is_cuda and _supports_shape(n, nkv)):
            return False
        y0 = y.data_ptr()
        return (y.stride() == (n, 1) and m <= rows_any_build(n, nkv) and y0 % ALIGN == 0
                and checks.fast_tokens_and_caches(m, y.get_device(), positions, slot_mapping, cos_sin_cache,
                                                  key_cache, value_cache, nkv)
                and not checks.meets_cache(y0, y0 + m * n * 2, key_cache)
                and not checks.meets_cache(y0, y0 + m * n * 2, value_cache))
    except (AttributeError, TypeError, ValueError, IndexError):  # not tensors, wrong ranks: the slow path says why
        return False


def unsupported(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> str | None:
    """Why the qkv_epilogue kernel cannot take this call (checked before launch), or None."""
    if _fast_ok(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps):
        return None
    r = _layout_reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps)
    if r:
        return r
    return checks.device_reason("y", y, (("positions", positions), ("cos_sin_cache", cos_sin_cache),
                                         ("slot_mapping", slot_mapping), ("key_cache", key_cache),
                                         ("value_cache", value_cache)))


# ---------------------------------------------------------------- launch
# How each value of the kernel's launch ABI (kernels/qkv_epilogue.py::abi_for) is computed from a call; the loaded
# kernel's param_names give the order (ops/_bind.py).
_ARGS = "y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps"
_VALUES = {
    "y": "y.data_ptr()", "positions": "positions.data_ptr()", "cos_sin_cache": "cos_sin_cache.data_ptr()",
    "slot_mapping": "slot_mapping.data_ptr()", "key_cache": "key_cache.data_ptr()",
    "value_cache": "value_cache.data_ptr()", "M": "y.shape[0]",
    "num_q_heads": f"(y.shape[1] // {EPI_HEAD_DIM} - 2 * num_kv_heads) // 2", "num_kv_heads": "num_kv_heads",
    "ld_y": "y.stride(0) if y.shape[0] > 1 else y.shape[1]", "max_pos": "cos_sin_cache.shape[0]",
    "block_size": "key_cache.shape[1]", "num_blocks": "key_cache.shape[0]", "k_block_stride": "key_cache.stride(0)",
    "v_block_stride": "value_cache.stride(0)", "eps": "float(eps)",
}
_all_values = binder("qkv_epilogue", tuple(_VALUES), _VALUES, _ARGS)


def launch_args(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> dict:
    """The values of every ABI field by name (kernels/qkv_epilogue.py::abi_for); LoadedKernel.launch packs them."""
    return dict(zip(_VALUES, _all_values(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                                         num_kv_heads, eps), strict=True))


@functools.lru_cache(maxsize=None)
def _loaded(v: QkvEpilogueVariant, device_index: int):
    """(loaded kernel, its binder) of a build on a device (once per process)."""
    from ..runtime import get_kernel

    kernel = get_kernel(v, device=device_index)
    return kernel, binder(v.label, kernel.param_names, _VALUES, _ARGS)


def launch(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
           variant: QkvEpilogueVariant | None = None) -> torch.Tensor:
    """No checks: launch the build this call takes (or `variant`) on torch's current stream; y is rewritten in
    place and returned. M == 0 launches nothing."""
    m, n = y.shape
    if m == 0:
        return y
    v = variant or epilogue_variant(n, m, num_kv_heads)
    dev = y.get_device()
    kernel, bind = _loaded(v, dev if dev >= 0 else torch.cuda.current_device())
    kernel.launch_ordered(launch_grid(v, m, n, num_kv_heads), bind(y, positions, cos_sin_cache, slot_mapping,
                                                                   key_cache, value_cache, num_kv_heads, eps))
    return y


def qkv_epilogue(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps) -> torch.Tensor:
    """Checked qkv_epilogue (in place on y, which it returns): raises TypeError (wrong types / dtypes) or
    ValueError with the reason, else launches."""
    reason = unsupported(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps)
    if reason is not None:
        checks.raise_for("qkv_epilogue", reason)
    return launch(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps)


def prepare(N: int, rows, num_kv_heads: int | None = None, device=None) -> list:
    """Load every build the calls with N columns and M in `rows` take (before CUDA graph capture).

    `rows`: an int (every M in 1..rows) or an iterable of M values. `num_kv_heads` defaults to the bundled
    model's shard of this N. Returns the loaded kernels (raises MissingKernelError, naming the `musekern
    prepare` command, if one is not in the cache).
    """
    from .qkv_front import prepare_args

    dev, num_kv_heads, ms = prepare_args(N, rows, num_kv_heads, device)
    builds = dict.fromkeys(epilogue_variant(N, m, num_kv_heads) for m in ms)
    return [_loaded(v, dev)[0] for v in builds]


__all__ = ["unsupported", "launch", "launch_args", "qkv_epilogue", "prepare"]
