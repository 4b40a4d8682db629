"""torch custom ops in the `musekern` namespace: what a serving engine calls inside its compiled model.

Importing this module registers (once per process):

    torch.ops.musekern.qkv_front(Tensor x, Tensor weight, Tensor positions, Tensor cos_sin_cache,
        Tensor slot_mapping, Tensor(a!) key_cache, Tensor(b!) value_cache, int num_kv_heads, float eps,
        Tensor? k_scale=None, Tensor? v_scale=None, Tensor? weight_scale=None) -> Tensor
    torch.ops.musekern.qk_norm(Tensor x, int head_dim, float eps=1e-05, float scale=1.0) -> Tensor

`qkv_front` writes k and v into the two caches in place (the schema says so: torch.compile functionalizes
the call and re-inplaces it) and returns a new y [M, N]; bf16 caches, or FP8 (float8_e4m3fn / uint8) ones with
the per-tensor `k_scale` / `v_scale` (one-element float32 tensors, read on the device; None: 1.0); a bf16 weight,
or a float8_e4m3fn one with its `weight_scale` (float32 [N] or [N // 64, 64]: musekern.weights.pack). Its CUDA
kernel is `ops.qkv_front.op_call` (the checked call, every M: the fused front or cuBLAS + the fused epilogue),
its CPU kernel the plain-torch reference: together what `qkv_front_auto` does, without its device test.
`qk_norm` runs the cached kernel on CUDA tensors, the reference on CPU tensors. Each op has a fake (meta)
implementation, so it traces under torch.compile with `fullgraph=True` and dynamic M.

Registration route: `torch.library.Library` + `.impl` + `register_fake`, not `torch.library.custom_op`:
the latter wraps every call in Python bookkeeping that costs several times the kernel launch
(bench/engine_host.py measures both routes side by side). The kernels' checks run once per call, in the
impl (the fake checks nothing: trace time only needs the output's shape).

Before capturing a CUDA graph, load every kernel the captured shapes take: `prepare(...)` below.
"""
from __future__ import annotations

import torch

from . import qk_norm as _qk_norm
from . import qkv_front as _qkv_front

NAMESPACE = "musekern"
QKV_FRONT_SCHEMA = ("qkv_front(Tensor x, Tensor weight, Tensor positions, Tensor cos_sin_cache, Tensor slot_mapping, "
                    "Tensor(a!) key_cache, Tensor(b!) value_cache, int num_kv_heads, float eps, "
                    "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? weight_scale=None) -> Tensor")
QK_NORM_SCHEMA = "qk_norm(Tensor x, int head_dim, float eps=1e-05, float scale=1.0) -> Tensor"
# Inductor must hand the ops the strides eager would (qk_norm takes strided rows of a fused projection, qkv_front
# needs a contiguous x); pt2_compliant: opcheck passes on both (tests/test_ops_library.py, tests/test_gpu_engine.py).
_TAGS = (torch.Tag.needs_fixed_stride_order, torch.Tag.pt2_compliant_tag)


# ---------------------------------------------------------------- kernels (CPU and CUDA), fakes
def _qkv_front_cpu(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                   k_scale=None, v_scale=None, weight_scale=None):
    from ..reference import qkv_front_reference

    return qkv_front_reference(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                               num_kv_heads, eps, None, k_scale, v_scale, weight_scale)


def _qkv_front_fake(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps,
                    k_scale=None, v_scale=None, weight_scale=None):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def _qk_norm_cuda(x, head_dim, eps=1e-5, scale=1.0):
    return _qk_norm.qk_norm(x, head_dim, eps, scale)


def _qk_norm_cpu(x, head_dim, eps=1e-5, scale=1.0):
    reason = _qk_norm.qk_norm_unsupported(x, head_dim)
    if reason is not None:
        raise ValueError(f"qk_norm: {reason}")
    from ..reference import qk_norm_reference

    return qk_norm_reference(x, head_dim, eps, scale)


def _qk_norm_fake(x, head_dim, eps=1e-5, scale=1.0):
    return x.new_empty((x.shape[0], x.shape[1]))


def _register() -> torch.library.Library:
    # FRAGMENT: other modules (the M > 16 epilogue) may add their ops to the same namespace
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib.define(QKV_FRONT_SCHEMA, tags=_TAGS)
    lib.define(QK_NORM_SCHEMA, tags=_TAGS)
    lib.impl("qkv_front", _qkv_front.op_call, "CUDA")  # the checked call: every M, checks once
    lib.impl("qkv_front", _qkv_front_cpu, "CPU")
    lib.impl("qk_norm", _qk_norm_cuda, "CUDA")
    lib.impl("qk_norm", _qk_norm_cpu, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::qkv_front", _qkv_front_fake, lib=lib)
    torch.library.register_fake(f"{NAMESPACE}::qk_norm", _qk_norm_fake, lib=lib)
    return lib


_LIB = _register()  # kept alive: the registrations last as long as this object
qkv_front = torch.ops.musekern.qkv_front.default
qk_norm = torch.ops.musekern.qk_norm.default


def register_ops():
    """The `torch.ops.musekern` namespace, its ops registered (importing this module registers them)."""
    return torch.ops.musekern


# ---------------------------------------------------------------- before CUDA graph capture
def prepare(n: int, rows=16, num_kv_heads: int | None = None, qk_norm_head_dims=(),
            dtype=torch.bfloat16, device=None, kv_cache_dtype: str = "auto", weight_format="bf16") -> list:
    """Load every kernel the ops take for weight rows N and M in `rows`, and time cuBLAS's algorithms for the M the
    GEMM path takes (up to 512: `gemm.tune.tune`, 0.06-0.5 s an M, one checked launch an M the cache's tuning record
    holds), before a CUDA graph is captured.

    `rows`: an int (every M in 1..rows) or an iterable of M values, as `ops.qkv_front.prepare` takes them;
    `kv_cache_dtype`: the KV caches the calls write ("auto" / "bf16", "fp8" / "fp8_e4m3": musekern/kv_cache.py);
    `weight_format`: the weight the calls pass ("bf16", "fp8-block", "fp8-channel", ...: `ops.qkv_front.prepare`);
    `qk_norm_head_dims`: the head sizes the model's qk_norm calls use (every build of each is loaded: with
    and without a scale, for small and large inputs). Raises MissingKernelError (naming the
    `musekern prepare` command) when one is not in the cache. Returns the loaded kernels.
    """
    from . import qk_norm as _qk_norm

    kernels = list(_qkv_front.prepare(n, rows, num_kv_heads=num_kv_heads, device=device,
                                      kv_cache_dtype=kv_cache_dtype, weight_format=weight_format))
    for hd in qk_norm_head_dims:
        kernels += _qk_norm.prepare(hd, dtype, device)
    return kernels


__all__ = ["NAMESPACE", "QKV_FRONT_SCHEMA", "QK_NORM_SCHEMA", "qkv_front", "qk_norm", "prepare", "register_ops"]
