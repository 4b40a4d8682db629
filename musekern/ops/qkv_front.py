"""musekern.qkv_front: the Muse Spark attention front, for every M, on cached kernels (no compiler at run time).

qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
          out=None, k_scale=None, v_scale=None, weight_scale=None) -> y
computes y = bf16(x @ weight^T), RMS-norms + RoPEs the q and k heads, and writes k and v into the paged caches
(musekern.reference.qkv_front_reference, which it equals up to the GEMM's summation order). The weight: bf16, or FP8
(issue 30: float8_e4m3fn [N, 8192] with `weight_scale`, float32 [N] per row or [N // 64, 64] per 64 rows x 128 K,
musekern.weights.pack's canonical layout; the scale's shape picks the builds). Caches: bf16, or FP8
ones (float8_e4m3fn / uint8: e4m3 of k / k_scale, v / v_scale, as vLLM's `--kv-cache-dtype fp8`; the scales a
float, or a one-element float32 tensor the kernel reads on the device: a CUDA graph replay reads its value then).
On the GPU each call takes one of two paths, by the planner's measured rule for (N, M, this GPU)
(`kernels.qkv_front.rules.front_serves`):
- the fused front: one CuTe DSL launch (split-K GEMM, norm, RoPE, y store, K/V insert);
- cuBLAS's GEMM into y (`gemm.tune.mm`: the algorithm `prepare` measured fastest for the shape, else `torch.mm`;
  FP8 weights: `gemm.fp8.mm`) + the fused epilogue (musekern.ops.qkv_epilogue), for every other M (FP8 weights: the
  front's builds serve M <= 16, the GEMM path every M above).
Either way: no host sync, nothing allocated but y (none with `out=`), capturable in a CUDA graph once `prepare`
has loaded the builds the M values need. One contract PDL adds: the fused front streams `weight` before it waits for
the kernel launched just before it on the stream (x, positions, slots, the caches and scales only after), so the
kernel that writes `weight` (a load, a refit) must not be that one, nor be followed only by PDL-launched kernels
(musekern's own) up to the front: one plain launch between them (any torch op) orders it. `qkv_front_auto` is the
same on CUDA tensors and the plain-torch reference on CPU tensors. Importing this module never imports cutlass.
"""
from __future__ import annotations

import functools

import torch

from ..gemm import fp8 as gemm_fp8
from ..gemm import tune as gemm
from ..kernels.qkv_front.rules import front_serves, variant
from ..kernels.qkv_front.variant import QkvFrontVariant, launch_grid
from ..kernels.x_quant.variant import XQ_GROUP
from ..kv_cache import BF16 as KV_BF16
from ..kv_cache import FP8_E4M3, resolve
from ..model import HIDDEN, supports_shape
from . import checks, qkv_epilogue, x_quant
from ._bind import Plans, binder, take
from .checks import ALIGN, BF16, E4M3, F32, FP8_CACHES, I64, INF, NO_SCALES, is_tensor, overlaps


def hidden_rows_ok(x) -> bool:
    """x is a bf16 [M, 8192] matrix with M >= 1, contiguous and 16-byte aligned (TMA-able)."""
    return (is_tensor(x) and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == HIDDEN
            and x.shape[0] >= 1 and x.is_contiguous() and x.data_ptr() % ALIGN == 0)


def kv_cache_layout_ok(key_cache, value_cache, num_kv_heads: int) -> bool:
    """[num_blocks, block_size, num_kv_heads, 64] caches of one dtype (bf16, or FP8: float8_e4m3fn / uint8), inner
    three dims contiguous, any block stride that is a multiple of 8 (vLLM's split [2, blocks, ...] and FlashInfer's
    [blocks, 2, ...] NHD layouts), same shape."""
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        return False
    return checks.kv_reason(key_cache, value_cache, num_kv_heads) is None


def _matrix_reason(name: str, t, rows: str) -> str | None:
    """x or weight: a bf16 (weight: or e4m3) [rows, 8192] row-major, 16-byte aligned matrix (the front reads both
    with TMA)."""
    if not is_tensor(t):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if name == "weight":
        r = checks.weight_dtype_reason(t.dtype)
        if r:
            return r
    elif t.dtype != torch.bfloat16:
        return f"{name}.dtype must be bfloat16, got {t.dtype}"
    if t.dim() != 2 or t.shape[1] != HIDDEN:
        return f"{name} must be [{rows}, {HIDDEN}], got shape {tuple(t.shape)}"
    if t.shape[0] < 1:
        return f"{name} must have at least one row ({rows} >= 1), got shape {tuple(t.shape)}"
    if not t.is_contiguous():
        return f"{name} must be row-major contiguous, got strides {tuple(t.stride())}"
    if t.data_ptr() % ALIGN:
        return f"{name} must be {ALIGN}-byte aligned (data_ptr % {ALIGN} = {t.data_ptr() % ALIGN})"
    return None


def _layout_reason(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                   out, k_scale=None, v_scale=None, weight_scale=None) -> str | None:
    """Every check but the device one (so the rejections are testable with CPU tensors)."""
    r = _matrix_reason("x", x, "M") or _matrix_reason("weight", weight, "N")
    if r:
        return r
    m, n = x.shape[0], weight.shape[0]
    r = (checks.num_kv_heads_reason(num_kv_heads)
         or checks.layout_reason(n, num_kv_heads, supports_shape, "weight.shape[0]")
         or checks.weight_scale_reason(weight, weight_scale)
         or checks.token_inputs_reason(m, positions, slot_mapping, cos_sin_cache)
         or checks.kv_reason(key_cache, value_cache, num_kv_heads) or checks.eps_reason(eps)
         or checks.scales_reason(k_scale, v_scale))
    if r:
        return r
    if m > qkv_epilogue.rows_any_build(n, num_kv_heads):
        return (f"M={m} rows of N={n} exceed one launch's {qkv_epilogue.rows_any_build(n, num_kv_heads)} "
                "(Int32 thread index); split the call")
    if out is not None:
        if not is_tensor(out) or out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n):
            return f"out must be a bfloat16 tensor of shape ({m}, {n})"
        if not out.is_contiguous() or out.data_ptr() % ALIGN:
            return f"out must be contiguous and {ALIGN}-byte aligned"
        for name, t in (("x", x), ("key_cache", key_cache), ("value_cache", value_cache)):
            if overlaps(out, t):
                return f"out must not overlap {name} (it is written while {name} is still read or written)"
    return None


def _fast(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, out, dry,
          k_scale=None, v_scale=None, weight_scale=None):
    """The common valid call, checked reading each tensor attribute once, then (unless `dry`) launched with the values
    it read (the checked call's host cost): y, or True where `dry`; None for any other call (then `_reason` says
    why, or accepts a valid call this path leaves to it: a CPU x, an `out` view with a row stride). Stricter than
    `_reason`: whatever it accepts, that accepts."""
    try:
        bf, nkv, kd = BF16, num_kv_heads, key_cache.dtype
        w8 = weight_scale is not None  # an e4m3 weight: the one test a bf16 call adds
        if not (x.dtype is bf and weight.dtype is (E4M3 if w8 else bf) and value_cache.dtype is kd
                and (kd is bf or kd in FP8_CACHES) and positions.dtype is I64 and slot_mapping.dtype is I64
                and cos_sin_cache.dtype is F32
                and type(nkv) is int and type(eps) is float and 0.0 <= eps < INF and x.is_cuda):
            return None
        (m, k), (n, kw) = x.shape, weight.shape
        # is_contiguous: x's row stride is 8192 where M > 1 (with M = 1 the map's row stride is never used)
        if not (k == kw == HIDDEN and x.is_contiguous() and weight.is_contiguous()
                and 1 <= m <= qkv_epilogue.rows_limit(n, nkv)):
            return None
        x0, w0, dev = x.data_ptr(), weight.data_ptr(), x.get_device()
        if (x0 | w0) % ALIGN or weight.get_device() != dev:
            return None
        y0 = y1 = 0
        if out is not None:
            y0 = out.data_ptr()
            y1 = y0 + m * n * 2
            if not (out.dtype is bf and out.shape == (m, n) and out.stride() == (n, 1) and y0 % ALIGN == 0
                    and out.get_device() == dev and not (y0 < x0 + m * HIDDEN * 2 and x0 < y1)):
                return None
        sc = NO_SCALES if k_scale is None and v_scale is None else checks.fast_scales(k_scale, v_scale, dev)
        fp8 = kd is not bf
        tc = checks.fast_token_cache_values(m, dev, nkv, positions, slot_mapping, cos_sin_cache, key_cache,
                                            value_cache, y0, y1, 1 if fp8 else 2)
        if tc is None or sc is None:
            return None
        ws = checks.fast_weight_scale(weight_scale, n, dev) if w8 else None
        if w8 and ws is None:
            return None
    except (AttributeError, TypeError, IndexError, ValueError):  # not tensors, wrong ranks: `_reason` says why
        return None
    if dry:
        return True
    key = (n, m, nkv, dev)
    run = (_RUNS_W8[FP8_E4M3 if fp8 else KV_BF16, ws[1]] if w8 else _RUNS_FP8 if fp8 else _RUNS)[key]
    if out is None:
        out = x.new_empty(m, n)  # x's dtype (bf16) and device; int sizes parse faster than a tuple
        y0 = out.data_ptr()
    if run is _GEMM:  # y = x @ W^T by cuBLAS, then the epilogue in place with the values read here
        if w8:
            gemm_fp8.mm(x, weight, weight_scale, out, x_quant.quantize)
        elif not gemm.launch_tuned(n, m, dev, x0, w0, y0):
            torch.mm(x, weight.t(), out=out)
        qkv_epilogue.launch_read(key, y0, tc, eps, sc, fp8)
    else:  # `_VALUES` order (`_NAMES_W8`: the scale's address in weight_ptr's place)
        values = [(w0, n, HIDDEN, HIDDEN), (x0, m, HIDDEN, HIDDEN), m, ws[0] if w8 else w0, y0, *tc, eps]
        if fp8:
            values += sc  # `_NAMES_FP8`: then the scales
        run(values)
    return out


def _reason(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
            out, k_scale=None, v_scale=None, weight_scale=None) -> str | None:
    """Every check, one at a time, for the reason (the calls `_fast` does not take)."""
    r = _layout_reason(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads,
                       eps, out, k_scale, v_scale, weight_scale)
    if r:
        return r
    named = [("weight", weight), ("positions", positions), ("cos_sin_cache", cos_sin_cache),
             ("slot_mapping", slot_mapping), ("key_cache", key_cache), ("value_cache", value_cache),
             *checks.scale_tensors(k_scale, v_scale)] + ([("weight_scale", weight_scale)] if weight_scale is not None
                                                         else [])
    return checks.device_reason("x", x, named + ([("out", out)] if out is not None else []))


def unsupported(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                out=None, k_scale=None, v_scale=None, weight_scale=None) -> str | None:
    """Why the GPU path cannot take this call (checked before launch), or None."""
    if _fast(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, out, True,
             k_scale, v_scale, weight_scale):
        return None
    return _reason(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, out,
                   k_scale, v_scale, weight_scale)


# ---------------------------------------------------------------- launch
@functools.lru_cache(maxsize=None)
def _target(device_index: int):
    from ..targets import check_supported, local_target

    t = local_target(device_index)
    if t is None:
        raise RuntimeError(f"qkv_front: no CUDA device {device_index} visible to the driver")
    return check_supported(t)


@functools.lru_cache(maxsize=None)
def _variant(n: int, m: int, num_kv_heads: int, device_index: int, kv: str = KV_BF16, wd: str = "bf16",
             ws: str = "none") -> QkvFrontVariant:
    return variant(n, m, num_kv_heads, _target(device_index), kv, wd, ws)


@functools.lru_cache(maxsize=4096)
def _fused(n: int, m: int, device_index: int, wd: str = "bf16") -> bool:
    """Does the fused front serve (N, M) with a weight of `wd` on this device (the planner's rule)?"""
    return front_serves(n, m, _target(device_index), wd)


# How each value the front's launch ABI (kernels/qkv_front/abi.py) names is computed from a call; the loaded
# kernel's param_names pick theirs by name (ops/_bind.py). Tensor-map parameters take the tensor itself. The checked
# call's `_fast` reads the same values, in this order, while it checks them (tests/test_ops_qkv_front.py compares).
_ARGS = ("x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, eps, out, k_scale=None, "
         "v_scale=None, weight_scale=None")
_VALUES = {
    "weight": "weight", "x": "x", "M": "x.shape[0]", "weight_ptr": "weight.data_ptr()", "y": "out.data_ptr()",
    "positions": "positions.data_ptr()", "cos_sin_cache": "cos_sin_cache.data_ptr()",
    "slot_mapping": "slot_mapping.data_ptr()", "key_cache": "key_cache.data_ptr()",
    "value_cache": "value_cache.data_ptr()", "max_pos": "cos_sin_cache.shape[0]", "block_size": "key_cache.shape[1]",
    "num_blocks": "key_cache.shape[0]", "k_block_stride": "key_cache.stride(0)",
    "v_block_stride": "value_cache.stride(0)", "eps": "float(eps)",
    "weight_scale": "weight_scale.data_ptr()",  # e4m3-weight builds only, in weight_ptr's slot
}
_NAMES = tuple(n for n in _VALUES if n != "weight_scale")  # the values a bf16 build may take
_NAMES_FP8 = _NAMES + tuple(checks.SCALE_VALUES)  # an FP8-cache build's: the same, then the scales'
_NAMES_W8 = tuple("weight_scale" if n == "weight_ptr" else n for n in _NAMES)  # an e4m3-weight build's
_NAMES_W8_FP8 = _NAMES_W8 + tuple(checks.SCALE_VALUES)  # e4m3 weight, FP8 caches
_all_values = binder("qkv_front", _NAMES, _VALUES, _ARGS)
_fp8_values = binder("qkv_front", _NAMES_FP8, {**_VALUES, **checks.SCALE_VALUES}, _ARGS, checks.SCALE_ENV)
_w8_values = binder("qkv_front", _NAMES_W8, _VALUES, _ARGS)
_w8_fp8_values = binder("qkv_front", _NAMES_W8_FP8, {**_VALUES, **checks.SCALE_VALUES}, _ARGS, checks.SCALE_ENV)
# (cache dtype, e4m3 weight?) -> (the build's value names, their binder)
_BINDINGS = {(KV_BF16, False): (_NAMES, _all_values), (FP8_E4M3, False): (_NAMES_FP8, _fp8_values),
             (KV_BF16, True): (_NAMES_W8, _w8_values), (FP8_E4M3, True): (_NAMES_W8_FP8, _w8_fp8_values)}


def launch_args(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, eps, out, k_scale=None,
                v_scale=None, weight_scale=None) -> dict:
    """Every value a qkv_front build for these caches and this weight may take, by ABI name: the `args` of
    LoadedKernel.launch."""
    names, bind = _BINDINGS[checks.kv_dtype(key_cache), weight_scale is not None]
    return dict(zip(names, bind(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, eps, out,
                                k_scale, v_scale, weight_scale), strict=True))


@functools.lru_cache(maxsize=None)
def _front_plan(n: int, m: int, num_kv_heads: int, device_index: int, kv: str = KV_BF16, wd: str = "bf16",
                ws: str = "none"):
    """(loaded kernel, grid, its launcher of `_VALUES`-ordered values) of a fused-front call shape: once per process."""
    from ..runtime import get_kernel

    v = _variant(n, m, num_kv_heads, device_index, kv, wd, ws)
    kernel = get_kernel(v, device=device_index, on_miss=checks.on_miss())
    grid = launch_grid(v)
    names = _BINDINGS[kv, wd != "bf16"][0]
    if v.x_dtype != "bf16":  # W8A8 reading x quantized ahead: x_quant first
        x_quant.prepare(device_index, XQ_GROUP)
        return kernel, grid, _x_ahead(kernel.launcher(grid, take=take(v.label, kernel.param_names,
                                                                       names + ("x_scale",))), names, device_index)
    return kernel, grid, kernel.launcher(grid, take=take(v.label, kernel.param_names, names))


def _x_ahead(launch, names: tuple, device_index: int):
    """The launcher of a build reading x quantized ahead: x_quant (group 128, PDL) of the call's x, then the front
    with x's value replaced by the e4m3 copy's and its scales' address after the call's values."""
    xi, mi = names.index("x"), names.index("M")

    def run(values: list) -> None:
        x, m = values[xi], values[mi]
        ptr, ld = (x[0], x[3]) if type(x) is tuple else (x.data_ptr(), x.stride(0))
        q, s = x_quant.quantize_groups_at(ptr, m, ld, device_index)
        values[xi] = (q.data_ptr(), m, HIDDEN, HIDDEN)
        values.append(s.data_ptr())
        launch(values)
    return run


def _resolve(n: int, m: int, num_kv_heads: int, device_index: int, kv: str = KV_BF16, wd: str = "bf16",
             ws: str = "none"):
    """The plan of a call shape: the fused front's launcher, or _GEMM (the planner's rule)."""
    if _fused(n, m, device_index, wd):
        return _front_plan(n, m, num_kv_heads, device_index, kv, wd, ws)[2]
    return _GEMM


_GEMM = "cuBLAS GEMM + fused epilogue"  # the plan of a call shape the fused front does not serve
_RUNS = Plans(_resolve)  # (N, M, num_kv_heads, device) -> the front's launcher, or _GEMM
_RUNS_FP8 = Plans(lambda n, m, nkv, dev: _resolve(n, m, nkv, dev, FP8_E4M3))  # the same, FP8 caches
# the same, e4m3 weights: per (cache dtype, "channel" / "block")
_RUNS_W8 = {(kv, ws): Plans(lambda n, m, nkv, dev, kv=kv, ws=ws: _resolve(n, m, nkv, dev, kv, checks.W8_DTYPE, ws))
            for kv in (KV_BF16, FP8_E4M3) for ws in ("channel", "block")}


def _plans(kv: str, ws: str) -> Plans:
    """The plan table of a call with caches of `kv` and weight scales `ws` ("none": a bf16 weight)."""
    if ws != "none":
        return _RUNS_W8[kv, ws]
    return _RUNS if kv == KV_BF16 else _RUNS_FP8


def launch_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                 out, k_scale=None, v_scale=None, weight_scale=None) -> torch.Tensor:
    """No checks: the fused front for this call (its M must be one a front build serves), into `out`."""
    dev = x.get_device()
    dev = dev if dev >= 0 else torch.cuda.current_device()
    kv = checks.kv_dtype(key_cache)
    wd, ws = checks.weight_kind(weight_scale)
    run = _front_plan(weight.shape[0], x.shape[0], num_kv_heads, dev, kv, wd, ws)[2]
    run(_BINDINGS[kv, weight_scale is not None][1](x, weight, positions, cos_sin_cache, slot_mapping, key_cache,
                                                   value_cache, eps, out, k_scale, v_scale, weight_scale))
    return out


def launch_gemm_epilogue(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads,
                         eps, out, k_scale=None, v_scale=None, weight_scale=None) -> torch.Tensor:
    """No checks: cuBLAS's GEMM into `out` (the algorithm `prepare` measured fastest, else torch.mm's; an e4m3
    weight: `gemm.fp8.mm`), then the fused epilogue on it in place (every M)."""
    if weight_scale is None:
        gemm.mm(x, weight, out)
    else:
        gemm_fp8.mm(x, weight, weight_scale, out, x_quant.quantize)
    return qkv_epilogue.launch(out, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads,
                               eps, k_scale=k_scale, v_scale=v_scale)


def launch(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
           out=None, k_scale=None, v_scale=None, weight_scale=None) -> torch.Tensor:
    """No checks: the path the planner picks for this call, on torch's current stream."""
    m, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    dev = x.get_device()
    key = (n, m, num_kv_heads, dev if dev >= 0 else torch.cuda.current_device())
    kv = checks.kv_dtype(key_cache)
    run = _plans(kv, checks.weight_kind(weight_scale)[1])[key]
    if run is _GEMM:
        return launch_gemm_epilogue(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                                    num_kv_heads, eps, out, k_scale, v_scale, weight_scale)
    run(_BINDINGS[kv, weight_scale is not None][1](x, weight, positions, cos_sin_cache, slot_mapping, key_cache,
                                                   value_cache, eps, out, k_scale, v_scale, weight_scale))
    return out


def qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
              out=None, k_scale=None, v_scale=None, weight_scale=None) -> torch.Tensor:
    """Checked: raises TypeError (wrong types/dtypes) or ValueError with the reason, else launches. `k_scale`,
    `v_scale` (FP8 caches; a bf16 cache ignores them, as vLLM's "auto"): None (1.0), a float > 0, or a 0-dim /
    1-element float32 tensor on x's device (read by the kernel after its predecessor: graph-safe, no host sync).
    `weight_scale`: exactly with a float8_e4m3fn weight, its float32 dequant multipliers on x's device, [N] (per
    row) or [N // 64, 64] (per 64 rows x 128 K columns), contiguous, 16-byte aligned (musekern.weights.pack)."""
    y = _fast(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, out, False,
              k_scale, v_scale, weight_scale)
    if y is not None:
        return y
    # a rejected call (raise the reason), or a valid one the fast path leaves to the full checks
    reason = _reason(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, out,
                     k_scale, v_scale, weight_scale)
    if reason is not None:
        checks.raise_for("qkv_front", reason)
    return launch(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, out,
                  k_scale, v_scale, weight_scale)


def op_call(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
            k_scale=None, v_scale=None, weight_scale=None) -> torch.Tensor:
    """`qkv_front` in the custom op's argument order (ops/library.py: the dispatcher passes the scales where
    `qkv_front` takes `out`)."""
    return qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                     None, k_scale, v_scale, weight_scale)


def qkv_front_auto(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                   out=None, k_scale=None, v_scale=None, weight_scale=None) -> torch.Tensor:
    """`qkv_front` for CUDA tensors (every M, never the plain-torch path); the reference for CPU tensors."""
    if is_tensor(x) and x.is_cuda:
        return qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads,
                         eps, out, k_scale, v_scale, weight_scale)
    from ..reference import qkv_front_reference

    return qkv_front_reference(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                               num_kv_heads, eps, out, k_scale, v_scale, weight_scale)


def prepare(N: int, rows=16, num_kv_heads: int | None = None, device=None, kv_cache_dtype: str = "auto",
            weight_format="bf16") -> list:
    """Load every build the calls with weight rows N and M in `rows` take, fused front or GEMM + epilogue, and
    measure cuBLAS's algorithms for the GEMM path's M values up to `gemm.TUNE_MAX_ROWS` (`gemm.tune.tune`:
    0.06-0.5 s an M, or one checked launch where the cache's tuning record holds it; scratch weights of two layers
    or more while it runs): after this, those calls capture in a CUDA graph and the GEMM path runs the algorithm
    measured fastest.

    `rows`: an int (every M in 1..rows) or an iterable of M values. `num_kv_heads` defaults to the bundled
    model's shard of this N. `kv_cache_dtype`: the caches the calls write (musekern/kv_cache.py: "auto" / "bf16",
    "fp8" / "fp8_e4m3"). `weight_format`: the weight the calls pass, a spelling of `musekern prepare
    --weight-format` but "auto" ("bf16", "fp8-block", "fp8-block-ue8m0", "fp8-channel", "fp8-tensor") or a
    WeightFormat (a ModelConfig's `weight_format`). Returns the loaded kernels (raises MissingKernelError, naming
    the `musekern prepare` command, if one is not in the cache).
    """
    kv = resolve(kv_cache_dtype)
    wf = checks.weight_format(weight_format)
    dev, num_kv_heads, ms = checks.prepare_args(N, rows, num_kv_heads, device)
    fused = [m for m in ms if _fused(N, m, dev, wf.dtype)]
    # the front's launch plans (kernel, grid, binder) resolved here, so nothing but the launch is left for capture
    kernels = list(dict.fromkeys(_front_plan(N, m, num_kv_heads, dev, kv, wf.dtype, wf.kernel_scale)[0]
                                 for m in fused))
    rest = [m for m in ms if m not in fused]
    if rest:
        kernels += qkv_epilogue.prepare(N, rest, num_kv_heads, dev, kv)
        if not wf.fp8:  # e4m3 weights: gemm.fp8 (torch's _scaled_mm, or the bf16 copy's mm): nothing measured
            gemm.tune(N, rest, dev)  # cuBLAS's handles made and its algorithm measured per M, outside any capture
        elif wf.kernel_scale == "channel":
            kernels.append(x_quant.prepare(dev))  # the W8A8 path's x quantization
        elif gemm_fp8.block_scaled_mm(torch.device("cuda", dev)) is not None:  # else the bf16 copy's GEMM
            kernels.append(x_quant.prepare(dev, XQ_GROUP))
            gemm_fp8.note_torch_block_call(N, rest)
    return kernels


__all__ = ["unsupported", "hidden_rows_ok", "kv_cache_layout_ok", "launch", "launch_front", "launch_gemm_epilogue",
           "launch_args", "qkv_front", "qkv_front_auto", "prepare"]
