"""The checks the attention front's ops share (ops/qkv_front.py, ops/qkv_epilogue.py): one rule per input.

Each `*_reason` returns one line saying what is wrong with a call, or None; they read shapes, strides, dtypes and
addresses only (no host sync, CPU tensors work: the rejections are testable anywhere). `fast_token_cache_values`
is the same rules for the common valid call, reading each attribute once and returning the launch values it
read (the checked call's host cost): whatever it accepts, the reasons accept.
"""
from __future__ import annotations

import torch

from ..kv_cache import BF16 as KV_BF16
from ..kv_cache import E5M2_REASON, FP8_E4M3, SCALE_PARAMS
from ..model import HEAD_DIM as HEAD_COLS

ALIGN = 16  # TMA bases and 16-byte vector loads / stores
VEC = 8  # bf16 elements per 16 bytes: the caches' block strides are multiples of it
INT32_MAX = 2**31 - 1
# the fast paths' dtype and eps tests, as module constants (a global read each, no attribute lookup on torch)
BF16, I64, F32, INF = torch.bfloat16, torch.int64, torch.float32, float("inf")
F32_TINY, F32_MAX = 2.0 ** -149, 3.4028234663852886e38  # the positive float32 range a float scale must lie in
# An FP8 KV cache (kv_cache.FP8_E4M3): float8_e4m3fn, or uint8 holding e4m3 bytes (how vLLM allocates FP8 caches)
FP8_CACHES = (torch.float8_e4m3fn, torch.uint8)
CACHE_DTYPES = (BF16, *FP8_CACHES)
NO_SCALES = (0, 1.0, 0, 1.0)  # the scale launch values of a call without scales: (k ptr, k value, v ptr, v value)
# An FP8 weight (issue 30): float8_e4m3fn [N, 8192] + its float32 `weight_scale` in musekern.weights.pack's canonical
# layout, [N] ("channel": one per row, per-tensor checkpoints too) or [N // 64, 64] ("block": one per 64 rows x 128 K
# columns); the scale's rank says which. uint8 is not taken for a weight (unlike a cache, which vLLM allocates as
# uint8): checkpoints and engines hold e4m3 weights as float8_e4m3fn, and a uint8 weight could be any 8-bit format.
E4M3 = torch.float8_e4m3fn
W_BLOCK_COLS = 64  # block scales per row group: 8192 K columns / 128
W8_DTYPE = "fp8_e4m3"  # the variant's weight_dtype of an e4m3 weight (kernels/qkv_front/variant.py WEIGHT_DTYPES)


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


def cache_end(c0: int, shape, block_stride: int, esize: int = 2) -> int:
    """One past the last byte of a cache at `c0` of a layout `kv_reason` accepts (inner three dims contiguous) with
    `esize`-byte elements (2: bf16, 1: FP8)."""
    return c0 + ((shape[0] - 1) * block_stride + shape[1] * shape[2] * shape[3]) * esize


def meets_cache(a0: int, a1: int, c: torch.Tensor) -> bool:
    """Does the byte range [a0, a1) meet cache `c` (a layout `kv_reason` accepts)? The fast paths' overlap test: a
    few reads, where `overlaps` walks every dim."""
    c0 = c.data_ptr()
    return a0 < cache_end(c0, c.shape, c.stride(0), c.element_size()) and c0 < a1


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
    if c.dtype == torch.float8_e5m2:
        return f"{name}.dtype is float8_e5m2: {E5M2_REASON}"
    if c.dtype not in CACHE_DTYPES:
        return f"{name}.dtype must be bfloat16, or float8_e4m3fn / uint8 (an FP8 e4m3 cache), got {c.dtype}"
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
    """[num_blocks, block_size, num_kv_heads, 64] caches of one dtype (bf16, or FP8: float8_e4m3fn / uint8), inner
    three dims contiguous, any block stride that is a multiple of 8 elements (vLLM's split [2, blocks, ...] and
    FlashInfer's [blocks, 2, ...] NHD layouts), 16-byte aligned, the same shape."""
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        r = _cache_reason(name, c, num_kv_heads)
        if r:
            return r
    if key_cache.dtype != value_cache.dtype:
        return (f"key_cache.dtype {key_cache.dtype} and value_cache.dtype {value_cache.dtype} differ: both caches "
                f"must have one dtype")
    if tuple(key_cache.shape) != tuple(value_cache.shape):
        return f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in shape"
    if key_cache.data_ptr() == value_cache.data_ptr():
        # what inductor hands the op for `kv.view(float8).unbind(0)` of one uint8 cache inside a compiled region
        return ("key_cache and value_cache are the same memory (one data_ptr): k and v would overwrite each other; "
                "pass two caches (with torch.compile, view an FP8 cache as float8 outside the compiled region)")
    return None


def kv_dtype(key_cache) -> str:
    """The build dtype (kv_cache.BF16 or FP8_E4M3) of an accepted call's caches: which builds and launch values it
    takes. (The checked call's fast path tests the dtype it already read instead.)"""
    return KV_BF16 if key_cache.dtype == torch.bfloat16 else FP8_E4M3


def scale_reason(name: str, s) -> str | None:
    """k_scale / v_scale: None (1.0), a finite float > 0, or a float32 tensor of one element (0-dim or [1]: read on
    the device at launch, so a CUDA graph replay reads its value then). An FP8 cache stores e4m3(k / k_scale)."""
    if s is None:
        return None
    if is_tensor(s):
        if s.dtype != torch.float32:
            return f"{name}.dtype must be float32 (a per-tensor scale), got {s.dtype}"
        if s.numel() != 1:
            return f"{name} must be a 0-dim or 1-element tensor (one per-tensor scale), got shape {tuple(s.shape)}"
        return None
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        return f"{name} must be a float or a one-element float32 tensor, got {type(s).__name__}"
    if not 0 < s < INF:
        return f"{name} must be a finite float > 0, got {s!r}"
    if not F32_TINY <= s <= F32_MAX:
        return f"{name} must be a float32 scale ({F32_TINY!r} .. {F32_MAX!r}: the kernels' scale type), got {s!r}"
    return None


def scales_reason(k_scale, v_scale) -> str | None:
    return scale_reason("k_scale", k_scale) or scale_reason("v_scale", v_scale)


def scale_tensors(k_scale, v_scale) -> list:
    """(name, tensor) of the scales given as tensors: they must be on the call's CUDA device (`device_reason`)."""
    return [(n, s) for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if is_tensor(s)]


def fast_scales(k_scale, v_scale, dev: int) -> tuple | None:
    """The launch values (k ptr, k value, v ptr, v value) of the scales of a common valid call: a scale tensor is
    passed by address (0 otherwise) and read by the kernel, a float by value. None where `scales_reason` or the
    device check may reject it (then they say why). Raises AttributeError for a non-tensor, non-float."""
    out = []
    for s in (k_scale, v_scale):
        if s is None:
            out += (0, 1.0)
        elif type(s) is float:
            if not F32_TINY <= s <= F32_MAX:
                return None
            out += (0, s)
        elif s.dtype is F32 and s.numel() == 1 and s.get_device() == dev:
            out += (s.data_ptr(), 1.0)
        else:
            return None
    return tuple(out)


def scale_ptr(s) -> int:
    """The launch value `<k|v>_scale_ptr` of a scale: a tensor's address, else 0 (the kernel then takes the value)."""
    return s.data_ptr() if is_tensor(s) else 0


def scale_value(s) -> float:
    """The launch value `<k|v>_scale` of a scale: a float's value (None: 1.0; a tensor: read on the device)."""
    return 1.0 if s is None or is_tensor(s) else float(s)


# The scales' launch values of every build that writes an FP8 cache (kernels' `abi_for`): by ABI name, the
# expression over the call's `k_scale`, `v_scale` (ops/_bind.py), and the functions those call.
SCALE_VALUES = dict(zip((name for name, _, _ in SCALE_PARAMS), ("scale_ptr(k_scale)", "scale_value(k_scale)",
                                                                "scale_ptr(v_scale)", "scale_value(v_scale)"),
                        strict=True))
SCALE_ENV = {"scale_ptr": scale_ptr, "scale_value": scale_value}


def weight_dtype_reason(dtype) -> str | None:
    """The front's weight: bfloat16, or float8_e4m3fn (with a weight_scale)."""
    if dtype in (BF16, E4M3):
        return None
    if dtype == torch.float8_e5m2:
        return "weight.dtype is float8_e5m2: e5m2 weights are not served (FP8 checkpoints store e4m3: float8_e4m3fn)"
    hint = " (e4m3 bytes: pass weight.view(torch.float8_e4m3fn))" if dtype == torch.uint8 else ""
    return f"weight.dtype must be bfloat16, or float8_e4m3fn with its weight_scale, got {dtype}{hint}"


def weight_scale_reason(weight, weight_scale) -> str | None:
    """An e4m3 weight has its weight_scale, a bf16 one none; the scale is float32 [N] or [N // 64, 64], contiguous,
    16-byte aligned (the kernels read it with vector loads). Its values (finite, > 0) are not read: no host sync."""
    n, s = weight.shape[0], weight_scale
    if weight.dtype == E4M3 and s is None:
        return ("weight is float8_e4m3fn without its weight_scale: pass the float32 dequant multipliers "
                f"([N={n}] per row, or [{n // HEAD_COLS}, {W_BLOCK_COLS}] per 64 rows x 128 K columns)")
    if s is None:
        return None
    if weight.dtype != E4M3:
        return f"weight_scale goes with a float8_e4m3fn weight only; weight is {weight.dtype} (pass weight_scale=None)"
    if not is_tensor(s):
        return f"weight_scale must be a torch.Tensor, got {type(s).__name__}"
    if s.dtype != torch.float32:
        return f"weight_scale.dtype must be float32 (musekern.weights.pack's canonical scales), got {s.dtype}"
    if tuple(s.shape) not in ((n,), (n // HEAD_COLS, W_BLOCK_COLS)):
        return (f"weight_scale must be [N={n}] (one per row) or [{n // HEAD_COLS}, {W_BLOCK_COLS}] (one per 64 rows "
                f"x 128 K columns), got shape {tuple(s.shape)}")
    if not s.is_contiguous():
        return f"weight_scale must be contiguous, got strides {tuple(s.stride())}"
    if s.data_ptr() % ALIGN:
        return f"weight_scale must be {ALIGN}-byte aligned (data_ptr % {ALIGN} = {s.data_ptr() % ALIGN})"
    return None


def weight_kind(weight_scale) -> tuple[str, str]:
    """The build's (weight_dtype, weight_scale) of an accepted call: ("bf16", "none"), or ("fp8_e4m3", "channel" /
    "block") by the scale's rank."""
    if weight_scale is None:
        return "bf16", "none"
    return W8_DTYPE, "channel" if weight_scale.dim() == 1 else "block"


def fast_weight_scale(s, n: int, dev: int) -> tuple | None:
    """`weight_scale_reason` and the device check of an e4m3 weight's scale, reading each attribute once: (its
    address, "channel" / "block"), or None where they may reject it (then they say why)."""
    shape = s.shape
    mode = "channel" if shape == (n,) else "block" if shape == (n // HEAD_COLS, W_BLOCK_COLS) else None
    if mode is None or s.dtype is not F32 or not s.is_contiguous() or s.get_device() != dev:
        return None
    p = s.data_ptr()
    return None if p % ALIGN else (p, mode)


def device_reason(lead: str, t0: torch.Tensor, named) -> str | None:
    """Every tensor on `t0`'s CUDA device."""
    if not t0.is_cuda:
        return f"{lead} must be on a CUDA device, got {t0.device} (use musekern.reference for CPU tensors)"
    for name, t in named:
        if t.device != t0.device:
            return f"{name} is on {t.device}, {lead} on {t0.device}: all tensors must be on one CUDA device"
    return None


def _layout(ks, vs, kst, vst, cs, nkv: int, esize: int) -> tuple | None:
    """The caches' and cos_sin_cache's rules of `kv_reason` / `token_inputs_reason` on their shapes and strides, for
    the common valid call (exact strides): (max_pos, block_size, num_blocks, the two block strides, the bytes each
    cache spans), or None."""
    row = nkv * HEAD_COLS  # elements of one slot
    if not (len(ks) == 4 and ks == vs and ks[2] == nkv and ks[3] == HEAD_COLS and cs[1] == HEAD_COLS
            and 0 < cs[0] <= INT32_MAX // HEAD_COLS):
        return None
    nb, bs, kb, vb = ks[0], ks[1], kst[0], vst[0]
    if not (nb >= 1 and bs >= 1 and nb * bs <= INT32_MAX and bs * row <= INT32_MAX
            and kst[1:] == vst[1:] == (row, HEAD_COLS, 1) and kb >= bs * row and vb >= bs * row
            and (kb | vb) % VEC == 0):
        return None
    return cs[0], bs, nb, kb, vb, cache_end(0, ks, kb, esize), cache_end(0, vs, vb, esize)


_LAYOUTS: dict = {}  # (shapes and strides of the caches and cos_sin_cache, num_kv_heads, cache element size) ->
# _layout's accepted verdict


def fast_token_cache_values(m: int, dev: int, nkv: int, positions, slot_mapping, cos_sin_cache, key_cache,
                            value_cache, a0: int = 0, a1: int = 0, esize: int = 2) -> tuple | None:
    """`token_inputs_reason`, `kv_reason` and the device check of the common valid call, reading each attribute once,
    and that the bytes [a0, a1) (an output; a1 = 0: none) meet neither cache. Returns the launch values they give, in
    the ops' ABI order (positions, cos_sin_cache, slot_mapping, key_cache, value_cache addresses; max_pos, block_size,
    num_blocks, the two block strides), or None. Stricter than the reasons (exact cache strides, each tensor on CUDA
    device `dev`): whatever it accepts, they accept. The caller has checked the dtypes (the caches' element size is
    `esize`: 2 bf16, 1 FP8) and that nkv is an int; a
    tensor of another rank raises IndexError or TypeError (the caller's slow path then says why).

    The layout rules' verdict is kept per (shapes, strides, num_kv_heads) in a bounded dict: an engine's caches keep
    one layout, and the lookup costs a third of the rules (bench/host_cpu.py). Addresses and devices are read and
    checked on every call."""
    # is_contiguous is the reasons' rule for the token inputs (a size-1 dim's stride is never used), and one read
    if not (positions.shape == slot_mapping.shape == (m,) and positions.is_contiguous() and slot_mapping.is_contiguous()
            and cos_sin_cache.is_contiguous()):
        return None
    key = (key_cache.shape, value_cache.shape, key_cache.stride(), value_cache.stride(), cos_sin_cache.shape, nkv,
           esize)
    lay = _LAYOUTS.get(key)
    if lay is None:
        lay = _layout(*key)
        if lay is None:
            return None
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        _LAYOUTS[key] = lay
    c0, k0, v0 = cos_sin_cache.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr()
    if (c0 | k0 | v0) % ALIGN or k0 == v0 or (a1 and ((a0 < k0 + lay[5] and k0 < a1)
                                                      or (a0 < v0 + lay[6] and v0 < a1))):
        return None
    if not (positions.get_device() == slot_mapping.get_device() == cos_sin_cache.get_device() == key_cache.get_device()
            == value_cache.get_device() == dev):
        return None
    return positions.data_ptr(), c0, slot_mapping.data_ptr(), k0, v0, *lay[:5]


def raise_for(op: str, reason: str):
    """The checked calls' one exception rule: TypeError for a wrong type or dtype, else ValueError."""
    if "dtype" in reason or "must be a torch.Tensor" in reason or "must be an int" in reason:
        raise TypeError(f"{op}: {reason}")
    raise ValueError(f"{op}: {reason}")


# ---------------------------------------------------------------- prepare
def _default_kv_heads(n: int) -> int:
    from ..config import load_config

    for shard in load_config().shards():
        if shard.n == n:
            return shard.num_kv_heads
    raise ValueError(f"N={n} is not a shard of the default model; pass num_kv_heads")


def on_miss():
    """The loader's on_miss hook: the builder's autobuild where MUSEKERN_AUTOBUILD is on (it compiles a variant missing
    from the cache, with the build extra installed), else None. The only place the serving leg reaches the builder."""
    from .. import env

    if not env.flag(env.AUTOBUILD):
        return None
    from ..builder.autobuild import on_miss as build_on_miss

    return build_on_miss


def device_index(device=None) -> int:
    """The CUDA device index `device` names (None: torch's current device); a one-line error without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to torch (torch.cuda.is_available() is False): load and "
                           "launch kernels on the GPU machine, after `musekern prepare` built the cache")
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    idx = torch.device(device).index
    return idx if idx is not None else torch.cuda.current_device()


def weight_format(value):
    """The WeightFormat of a prepare call's `weight_format`: a WeightFormat, or an override spelling
    (formats.OVERRIDE_CHOICES) but "auto" (prepare reads no config); ValueError of one line otherwise."""
    from ..weights import formats

    if isinstance(value, formats.WeightFormat):
        return value
    choices = [c for c in formats.OVERRIDE_CHOICES if c != "auto"]
    try:
        wf = formats.parse_override(value)
    except ValueError:
        wf = None
    if wf is None:
        raise ValueError(f"weight_format must be one of {', '.join(choices)} or a WeightFormat, got {value!r}")
    return wf


def prepare_args(N: int, rows, num_kv_heads: int | None, device) -> tuple[int, int, list[int]]:
    """(device index, num_kv_heads, the sorted M values >= 1) of a prepare call: `rows` is an int (every M in
    1..rows) or M values; num_kv_heads defaults to the bundled model's shard of this N."""
    dev = device_index(device)
    if num_kv_heads is None:
        num_kv_heads = _default_kv_heads(N)
    ms = sorted({int(m) for m in (range(1, rows + 1) if isinstance(rows, int) else rows)} - {0})
    return dev, num_kv_heads, ms
