"""musekern.qkv_epilogue: the attention front's epilogue on a GEMM result (any M), on the cached CuTe DSL kernel.

qkv_epilogue(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale=None,
             v_scale=None) -> y
takes y = bf16(x @ W^T) [M, N] (q | k | v | gate, 64 columns a head, e.g. from torch.mm), RMS-norms and RoPEs
its q and k heads IN PLACE and writes k and v into the paged caches (bf16, or FP8 e4m3 of k / k_scale and
v / v_scale: musekern/kv_cache.py): musekern.reference.fused_qknorm_rope_kv_insert, without its copy of y.
No host sync, no allocation, capturable in a CUDA graph (`prepare` loads the builds first). Importing this
module never imports cutlass.
"""
from __future__ import annotations

import functools

import torch

from ..kernels.qkv_epilogue.variant import (
    EPI_HEAD_DIM,
    QkvEpilogueVariant,
    epilogue_variant,
    launch_grid,
    max_rows,
)
from ..kv_cache import BF16 as KV_BF16
from ..kv_cache import FP8_E4M3
from ..model import supports_shape
from . import checks
from ._bind import Plans, binder, take
from .checks import ALIGN, BF16, F32, FP8_CACHES, I64, INF, INT32_MAX, NO_SCALES, VEC, is_tensor, overlaps


@functools.lru_cache(maxsize=256)
def rows_any_build(n: int, num_kv_heads: int) -> int:
    """The largest M every build takes for this N in one launch (the one-vector build's limit is the lowest)."""
    return max_rows(QkvEpilogueVariant(1), n, num_kv_heads)


def _layout_reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale=None,
                   v_scale=None) -> str | None:
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
        return f"M={m} rows of N={n} exceed one launch's {limit} (Int32 unit index); split the call"
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
    return checks.eps_reason(eps) or checks.scales_reason(k_scale, v_scale)


@functools.lru_cache(maxsize=256)
def rows_limit(n: int, num_kv_heads: int) -> int:
    """The most rows one call of N columns takes (`rows_any_build`), 0 where N is no q|k|v|gate layout of these
    KV heads: one cached lookup for the fast paths' two shape questions."""
    return rows_any_build(n, num_kv_heads) if supports_shape(n, num_kv_heads) else 0


def _fast(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, dry, k_scale=None,
          v_scale=None):
    """The common valid call (contiguous y of M >= 1 on one CUDA device), checked reading each attribute once, then
    (unless `dry`) launched with the values it read: y, or True where `dry`; None for any other call (then
    `_layout_reason` and the device check say why, or accept it). Stricter than they are: whatever it accepts,
    they accept."""
    try:
        bf, nkv, kd = BF16, num_kv_heads, key_cache.dtype
        m, n = y.shape
        if not (y.dtype is bf and value_cache.dtype is kd and (kd is bf or kd in FP8_CACHES)
                and positions.dtype is I64 and slot_mapping.dtype is I64 and cos_sin_cache.dtype is F32
                and type(nkv) is int and type(eps) is float and 0.0 <= eps < INF and m >= 1 and y.is_cuda):
            return None
        dev = y.get_device()
        y0 = y.data_ptr()
        if not (y.stride() == (n, 1) and y0 % ALIGN == 0 and m <= rows_limit(n, nkv)):
            return None
        sc = NO_SCALES if k_scale is None and v_scale is None else checks.fast_scales(k_scale, v_scale, dev)
        fp8 = kd is not bf
        tc = checks.fast_token_cache_values(m, dev, nkv, positions, slot_mapping, cos_sin_cache, key_cache,
                                            value_cache, y0, y0 + m * n * 2, 1 if fp8 else 2)
        if tc is None or sc is None:
            return None
    except (AttributeError, TypeError, ValueError, IndexError):  # not tensors, wrong ranks: the slow path says why
        return None
    if dry:
        return True
    launch_read((n, m, nkv, dev), y0, tc, eps, sc, fp8)
    return y


def launch_read(key: tuple, y0: int, tc: tuple, eps: float, sc: tuple = NO_SCALES, fp8: bool = False) -> None:
    """No checks: the launch of a contiguous y (address y0) of call shape key = (N, M, num_kv_heads, device), with
    the values `checks.fast_token_cache_values` read (`tc`) and the scales' (`sc`: `checks.fast_scales`) into
    caches of bf16 or (`fp8`) e4m3: the checked calls' launch, nothing read twice."""
    n, m, nkv, _ = key
    # `_VALUES` order (FP8: `_NAMES_FP8`, the scales last); y is contiguous: its row stride is N
    if fp8:
        _RUNS_FP8[key]([y0, *tc[:5], m, (n // EPI_HEAD_DIM - 2 * nkv) // 2, nkv, n, *tc[5:], eps, *sc])
    else:
        _RUNS[key]([y0, *tc[:5], m, (n // EPI_HEAD_DIM - 2 * nkv) // 2, nkv, n, *tc[5:], eps])


def unsupported(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale=None,
                v_scale=None) -> str | None:
    """Why the qkv_epilogue kernel cannot take this call (checked before launch), or None."""
    if _fast(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, True, k_scale,
             v_scale):
        return None
    return _reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale,
                   v_scale)


def _reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale=None,
            v_scale=None) -> str | None:
    """Every check, one at a time, for the reason (the calls `_fast` does not take)."""
    r = _layout_reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale,
                       v_scale)
    if r:
        return r
    return checks.device_reason("y", y, (("positions", positions), ("cos_sin_cache", cos_sin_cache),
                                         ("slot_mapping", slot_mapping), ("key_cache", key_cache),
                                         ("value_cache", value_cache), *checks.scale_tensors(k_scale, v_scale)))


# ---------------------------------------------------------------- launch
# How each value of the kernel's launch ABI (kernels/qkv_epilogue/abi.py) is computed from a call; the loaded
# kernel's param_names give the order (ops/_bind.py). The FP8 builds take the four scale values too.
_ARGS = ("y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale=None, "
         "v_scale=None")
_VALUES = {
    "y": "y.data_ptr()", "positions": "positions.data_ptr()", "cos_sin_cache": "cos_sin_cache.data_ptr()",
    "slot_mapping": "slot_mapping.data_ptr()", "key_cache": "key_cache.data_ptr()",
    "value_cache": "value_cache.data_ptr()", "M": "y.shape[0]",
    "num_q_heads": f"(y.shape[1] // {EPI_HEAD_DIM} - 2 * num_kv_heads) // 2", "num_kv_heads": "num_kv_heads",
    "ld_y": "y.stride(0) if y.shape[0] > 1 else y.shape[1]", "max_pos": "cos_sin_cache.shape[0]",
    "block_size": "key_cache.shape[1]", "num_blocks": "key_cache.shape[0]", "k_block_stride": "key_cache.stride(0)",
    "v_block_stride": "value_cache.stride(0)", "eps": "float(eps)",
}
_NAMES = tuple(_VALUES)  # the values a bf16 build takes
_NAMES_FP8 = _NAMES + tuple(checks.SCALE_VALUES)  # an FP8 build's: the same, then the scales'
_all_values = binder("qkv_epilogue", _NAMES, _VALUES, _ARGS)
_fp8_values = binder("qkv_epilogue", _NAMES_FP8, {**_VALUES, **checks.SCALE_VALUES}, _ARGS, checks.SCALE_ENV)


def launch_args(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale=None,
                v_scale=None) -> dict:
    """The values of every ABI field of the build for these caches by name (kernels/qkv_epilogue/abi.py);
    LoadedKernel.launch packs them."""
    fp8 = checks.kv_dtype(key_cache) != KV_BF16
    return dict(zip(_NAMES_FP8 if fp8 else _NAMES, (_fp8_values if fp8 else _all_values)(
        y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale, v_scale),
        strict=True))


@functools.lru_cache(maxsize=None)
def _loaded(v: QkvEpilogueVariant, device_index: int):
    """(loaded kernel, the index of each of its parameters among `_VALUES`) of a build on a device (once per
    process)."""
    from ..runtime import get_kernel

    kernel = get_kernel(v, device=device_index, on_miss=checks.on_miss())
    return kernel, take(v.label, kernel.param_names, _NAMES if v.kv_cache_dtype == KV_BF16 else _NAMES_FP8)


@functools.lru_cache(maxsize=1024)
def _launcher(v: QkvEpilogueVariant, m: int, n: int, num_kv_heads: int, device_index: int):
    """The launcher of build `v` for a call shape (its grid), taking `_VALUES`-ordered values."""
    kernel, order = _loaded(v, device_index)
    return kernel.launcher(launch_grid(v, m, n, num_kv_heads), take=order)


def _resolve(n: int, m: int, num_kv_heads: int, device_index: int, kv: str = KV_BF16):
    return _launcher(epilogue_variant(n, m, num_kv_heads, kv), m, n, num_kv_heads, device_index)


_RUNS = Plans(_resolve)  # (N, M, num_kv_heads, device) -> the launcher of the build the rule picks
_RUNS_FP8 = Plans(lambda n, m, nkv, dev: _resolve(n, m, nkv, dev, FP8_E4M3))  # the same, FP8 caches


def launch(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
           variant: QkvEpilogueVariant | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """No checks: launch the build this call takes (or `variant`) on torch's current stream; y is rewritten in
    place and returned. M == 0 launches nothing."""
    m, n = y.shape
    if m == 0:
        return y
    dev = y.get_device()
    dev = dev if dev >= 0 else torch.cuda.current_device()
    fp8 = (checks.kv_dtype(key_cache) if variant is None else variant.kv_cache_dtype) != KV_BF16
    plans = _RUNS_FP8 if fp8 else _RUNS
    run = plans[(n, m, num_kv_heads, dev)] if variant is None else _launcher(variant, m, n, num_kv_heads, dev)
    run((_fp8_values if fp8 else _all_values)(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                                              num_kv_heads, eps, k_scale, v_scale))
    return y


def qkv_epilogue(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale=None,
                 v_scale=None) -> torch.Tensor:
    """Checked qkv_epilogue (in place on y, which it returns): raises TypeError (wrong types / dtypes) or
    ValueError with the reason, else launches. `k_scale`, `v_scale` (FP8 caches; a bf16 cache ignores them): None
    (1.0), a float, or a one-element float32 tensor on y's device, read by the kernel at launch."""
    if _fast(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, False, k_scale,
             v_scale) is not None:
        return y
    reason = _reason(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, k_scale,
                     v_scale)
    if reason is not None:
        checks.raise_for("qkv_epilogue", reason)
    return launch(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                  k_scale=k_scale, v_scale=v_scale)


def prepare(N: int, rows, num_kv_heads: int | None = None, device=None, kv_cache_dtype: str = "auto") -> list:
    """Load every build the calls with N columns and M in `rows` take (before CUDA graph capture).

    `rows`: an int (every M in 1..rows) or an iterable of M values. `num_kv_heads` defaults to the bundled
    model's shard of this N. `kv_cache_dtype`: the caches the calls write (musekern/kv_cache.py: "auto" / "bf16",
    "fp8" / "fp8_e4m3"). Returns the loaded kernels (raises MissingKernelError, naming the `musekern prepare`
    command, if one is not in the cache).
    """
    from ..kv_cache import resolve

    kv = resolve(kv_cache_dtype)
    dev, num_kv_heads, ms = checks.prepare_args(N, rows, num_kv_heads, device)
    builds = dict.fromkeys(epilogue_variant(N, m, num_kv_heads, kv) for m in ms)
    return [_loaded(v, dev)[0] for v in builds]


__all__ = ["unsupported", "launch", "launch_args", "qkv_epilogue", "prepare"]
