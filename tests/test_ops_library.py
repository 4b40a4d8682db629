"""torch.ops.musekern.*: schemas, fake implementations, opcheck, the CPU kernels, torch.compile (all on CPU).

The same checks on CUDA tensors (the cached kernels, inductor, CUDA graphs) are in tests/test_gpu_engine.py.
"""
from __future__ import annotations

import functools
import math

import pytest

torch = pytest.importorskip("torch")

from engine_scenario import EPS, Ops, front_args, module_args, same  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from musekern.config import load_config  # noqa: E402
from musekern.ops import library  # noqa: E402
from musekern.reference import qk_norm_reference, qkv_front_reference, rope_cos_sin_table  # noqa: E402

K, D = 8192, 64
SHARDS = {s.tp: s for s in load_config().shards()}  # the planned N: 2176 / 4352 / 8704 / 17408
OPS = torch.ops.musekern


@functools.lru_cache(maxsize=None)
def weight(tp):
    g = torch.Generator().manual_seed(tp)
    return (torch.randn(SHARDS[tp].n, K, generator=g) / math.sqrt(K)).to(torch.bfloat16)


def case(m=5, tp=8, layout="vllm", num_blocks=8, block_size=4, max_pos=64, seed=0, pad=False):
    """CPU inputs of one qkv_front call; `kv` is the one tensor both caches are views of."""
    g = torch.Generator().manual_seed(seed)
    s = SHARDS[tp]
    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
    w = weight(tp)
    pos = torch.randint(0, max_pos, (m,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:m]
    if pad:
        slots[::3] = -1
    shape = (2, num_blocks, block_size, s.num_kv_heads, D) if layout == "vllm" else \
        (num_blocks, 2, block_size, s.num_kv_heads, D)
    kv = torch.full(shape, -7.0, dtype=torch.bfloat16)
    return dict(x=x, weight=w, positions=pos, cos_sin_cache=rope_cos_sin_table(max_pos, 1e6), slot_mapping=slots,
                kv=kv, num_kv_heads=s.num_kv_heads, layout=layout)


# ---------------------------------------------------------------- schemas
def test_schemas_name_the_mutated_caches_and_fresh_outputs():
    front = OPS.qkv_front.default._schema
    assert str(front) == f"musekern::{library.QKV_FRONT_SCHEMA}"
    written = [a.name for a in front.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["key_cache", "value_cache"]
    norm = OPS.qk_norm.default._schema
    assert [a.name for a in norm.arguments] == ["x", "head_dim", "eps", "scale"]
    assert not any(a.alias_info for a in norm.arguments)
    assert [a.default_value for a in norm.arguments[2:]] == [1e-5, 1.0]
    for schema in (front, norm):  # outputs are new tensors (no alias of an input)
        assert len(schema.returns) == 1 and schema.returns[0].alias_info is None
    for op in (OPS.qkv_front.default, OPS.qk_norm.default):
        assert torch.Tag.pt2_compliant_tag in op.tags and torch.Tag.needs_fixed_stride_order in op.tags


# ---------------------------------------------------------------- fake implementations
def fake_front(s, m, weight_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, extra=lambda s: ()):
    """y of torch.ops.musekern.qkv_front under FakeTensorMode for shard `s` and M = m (`extra(s)`: the optional
    arguments after eps, made inside the mode)."""
    with FakeTensorMode():
        kv = torch.empty(2, 4, 16, s.num_kv_heads, D, dtype=cache_dtype)
        return OPS.qkv_front(torch.empty(m, K, dtype=torch.bfloat16), torch.empty(s.n, K, dtype=weight_dtype),
                             torch.empty(m, dtype=torch.int64), torch.empty(64, D), torch.empty(m, dtype=torch.int64),
                             kv[0], kv[1], s.num_kv_heads, EPS, *extra(s))


# Every planned N (TP 1..8), M at the kernels' edges (1, 16) and above them (17, 300: the M > 16 path).
@pytest.mark.parametrize("tp", sorted(SHARDS))
@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_qkv_front_fake_shape(tp, m):
    s = SHARDS[tp]
    y = fake_front(s, m)
    assert (tuple(y.shape), y.stride(), y.dtype) == ((m, s.n), (s.n, 1), torch.bfloat16)


# strided rows (q heads inside a fused row) come out contiguous; both dtypes the kernel takes
@pytest.mark.parametrize("m,hd,ld,dtype", [(1, 64, 1024, torch.bfloat16), (7, 128, 2176, torch.bfloat16),
                                           (300, 64, 1024, torch.float16)])
def test_qk_norm_fake_shape(m, hd, ld, dtype):
    for mode in ("fake", "meta"):
        if mode == "fake":
            with FakeTensorMode():
                out = OPS.qk_norm(torch.empty(m, ld, dtype=dtype)[:, :1024 - hd], hd)
        else:
            out = OPS.qk_norm(torch.empty(m, ld, dtype=dtype, device="meta")[:, :1024 - hd], hd)
        assert (tuple(out.shape), out.stride(), out.dtype) == ((m, 1024 - hd), (1024 - hd, 1), dtype)


def test_meta_tensors_take_the_fake():
    s = SHARDS[8]
    kv = torch.empty(2, 4, 16, 1, D, dtype=torch.bfloat16, device="meta")
    i64 = torch.empty(3, dtype=torch.int64, device="meta")
    y = OPS.qkv_front(torch.empty(3, K, dtype=torch.bfloat16, device="meta"),
                      torch.empty(s.n, K, dtype=torch.bfloat16, device="meta"), i64,
                      torch.empty(64, D, device="meta"), i64, kv[0], kv[1], 1, EPS)
    assert y.device.type == "meta" and tuple(y.shape) == (3, s.n)


# ---------------------------------------------------------------- opcheck and the CPU kernels
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_opcheck_qkv_front_cpu(layout):
    c = case(m=5, layout=layout, pad=True)
    torch.library.opcheck(OPS.qkv_front.default, front_args(c))


@pytest.mark.parametrize("hd,scale", [(64, 1.0), (128, 0.125)])
def test_opcheck_qk_norm_cpu(hd, scale):
    x = torch.randn(6, 2176).to(torch.bfloat16)[:, :1024]  # strided rows
    torch.library.opcheck(OPS.qk_norm.default, (x, hd, 1e-6, scale))


def test_cpu_qkv_front_is_the_reference_and_writes_the_caches():
    c = case(m=6, tp=4, pad=True)
    want_kv = c["kv"].clone()
    want = qkv_front_reference(*front_args(c, want_kv))
    got = OPS.qkv_front(*front_args(c))
    assert torch.equal(got, want) and torch.equal(c["kv"], want_kv)
    assert not torch.equal(c["kv"], torch.full_like(c["kv"], -7.0))  # something was written


def test_cpu_qk_norm_is_the_reference_and_checks():
    x = torch.randn(5, 2176).to(torch.bfloat16)[:, :1024]
    assert torch.equal(OPS.qk_norm(x, 64, 1e-6, 0.5), qk_norm_reference(x, 64, 1e-6, 0.5))
    with pytest.raises(ValueError, match="head_dim must be one of"):
        OPS.qk_norm(x, 96)


# ---------------------------------------------------------------- torch.compile (CPU: the reference kernels)
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_fullgraph_compile_has_no_break_and_matches_eager_bitwise(layout):
    mod = Ops(layout)
    c = case(m=5, layout=layout, pad=True)
    explain = torch._dynamo.explain(mod)(*module_args(c, c["kv"].clone()))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    kv_eager = c["kv"].clone()
    want = mod(*module_args(c, kv_eager))
    got = compiled(*module_args(c))
    assert same(got, want) and torch.equal(c["kv"], kv_eager)


def _run_ms(compiled, mod, ms, mark):
    for i, m in enumerate(ms):
        c = case(m=m, num_blocks=16, seed=i)
        for t in (c["x"], c["positions"], c["slot_mapping"]):
            mark(t, 0)
        kv_eager = c["kv"].clone()
        want = mod(*module_args(c, kv_eager))
        got = compiled(*module_args(c))
        assert same(got, want) and torch.equal(c["kv"], kv_eager), f"M={m}"


# M across the kernels' range (2..16) and above it (17, 40: the M > 16 path), then M = 1.
def test_dynamic_m_compiles_once_for_the_range_and_once_for_m_1():
    """mark_dynamic: one graph serves every M >= 2; M = 1 gets one more (torch specializes sizes 0 and 1 of
    backed dynamic dims, whatever the ops: `mark_unbacked` avoids it, next test)."""
    mod = Ops("vllm")
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mod, backend=cnt, fullgraph=True)
    _run_ms(compiled, mod, [2, 3, 8, 9, 16, 17, 40], torch._dynamo.mark_dynamic)
    assert cnt.frame_count == 1
    _run_ms(compiled, mod, [1], torch._dynamo.mark_dynamic)
    assert cnt.frame_count == 2


def test_unbacked_m_compiles_once_for_every_m():
    from torch._dynamo.decorators import mark_unbacked

    mod = Ops("vllm")
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mod, backend=cnt, fullgraph=True)
    _run_ms(compiled, mod, [5, 1, 16, 17], mark_unbacked)
    assert cnt.frame_count == 1


def test_inductor_writes_the_caches_in_place():
    """Caches given as views of one graph input: inductor re-inplaces the functionalized op (no copy of a cache).
    (Two cache inputs that share storage would make it clone one whole cache and copy it back every call.)"""
    from torch._inductor.utils import run_and_get_code

    mod = Ops("vllm")
    c = case(m=5, pad=True)
    kv_eager = c["kv"].clone()
    want = mod(*module_args(c, kv_eager))
    got, codes = run_and_get_code(torch.compile(mod, fullgraph=True), *module_args(c))
    assert same(got, want) and torch.equal(c["kv"], kv_eager)
    code = "\n".join(codes)
    assert "musekern.qkv_front.default(" in code
    assert "clone" not in code and "copy_" not in code, "inductor copies a cache around the op"



def test_package_exports_register_the_ops():
    import musekern

    assert musekern.register_ops() is torch.ops.musekern
    assert musekern.prepare_ops is library.prepare
    assert library.qkv_front is OPS.qkv_front.default and library.qk_norm is OPS.qk_norm.default


# ---------------------------------------------------------------- FP8 KV caches with scales (issue 29)
def fp8_front_args(c, dtype, kv=None, k_scale=None, v_scale=None) -> tuple:
    """front_args with the caches as FP8 views of kv's bytes (both layouts) and the two scale tensors."""
    kc, vc = (c["kv"] if kv is None else kv).view(dtype).unbind(0 if c["layout"] == "vllm" else 1)
    return (*front_args(c)[:5], kc, vc, c["num_kv_heads"], EPS, k_scale, v_scale)


def fp8_case(layout="vllm", m=5, tp=8, **kw):
    c = case(m=m, tp=tp, layout=layout, pad=True, **kw)
    c["kv"] = torch.full(c["kv"].shape, 0xA5, dtype=torch.uint8)  # the same layout, one byte an element
    return c


def test_fp8_schema_takes_optional_scales():
    """The KV cache's scales (issue 29), then the FP8 weight's (issue 30): optional tensors after eps, in this order
    (an engine calling the op positionally with the cache scales keeps working)."""
    args = OPS.qkv_front.default._schema.arguments
    assert [(a.name, str(a.type), a.default_value) for a in args[-3:]] == [("k_scale", "Optional[Tensor]", None),
                                                                          ("v_scale", "Optional[Tensor]", None),
                                                                          ("weight_scale", "Optional[Tensor]", None)]
    assert [a.name for a in args[:9]][-2:] == ["num_kv_heads", "eps"]


# uint8 caches (how vLLM allocates them): opcheck's own schema test multiplies the mutated inputs, which torch's CPU
# float8 tensors do not support ("mul_cpu_reduced_float" not implemented); the float8 view is compiled below.
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_opcheck_qkv_front_fp8_cpu(layout):
    c = fp8_case(layout)
    torch.library.opcheck(OPS.qkv_front.default, fp8_front_args(c, torch.uint8, k_scale=torch.tensor(0.5),
                                                                v_scale=torch.tensor([2.0])))
    torch.library.opcheck(OPS.qkv_front.default, fp8_front_args(c, torch.uint8))


def test_fp8_fake_shape_with_scales():
    s = SHARDS[4]
    y = fake_front(s, 9, cache_dtype=torch.uint8, extra=lambda s: (torch.empty(()), torch.empty(1)))
    assert (tuple(y.shape), y.dtype) == ((9, s.n), torch.bfloat16)


def test_fp8_cpu_kernel_is_the_reference_with_the_scales():
    c = fp8_case(m=6)
    want_kv = c["kv"].clone()
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    want = qkv_front_reference(*fp8_front_args(c, torch.uint8, want_kv)[:9], None, ks, vs)
    got = OPS.qkv_front(*fp8_front_args(c, torch.uint8, k_scale=ks, v_scale=vs))
    assert torch.equal(got, want) and torch.equal(c["kv"], want_kv)
    assert not torch.equal(c["kv"], torch.full_like(c["kv"], 0xA5))


class Fp8Ops(torch.nn.Module):
    """The op as an engine's compiled layer calls it with an FP8 cache (a uint8 graph input) and scale tensors."""

    def forward(self, x, weight, positions, cos_sin_cache, slot_mapping, kv, k_scale, v_scale):
        kc, vc = kv.view(torch.float8_e4m3fn).unbind(0)
        return torch.ops.musekern.qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, kc, vc, kc.shape[2],
                                            EPS, k_scale, v_scale)


def test_fp8_fullgraph_compile_matches_eager_bitwise():
    mod = Fp8Ops()
    c = fp8_case()
    scales = (torch.tensor(0.5), torch.tensor(4.0))
    explain = torch._dynamo.explain(mod)(*module_args(c, c["kv"].clone()), *scales)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    kv_eager = c["kv"].clone()
    want = mod(*module_args(c, kv_eager), *scales)
    got = torch.compile(mod, backend="aot_eager", fullgraph=True)(*module_args(c), *scales)
    assert torch.equal(got, want) and torch.equal(c["kv"], kv_eager)


# ---------------------------------------------------------------- FP8 weights (issue 30)
@functools.lru_cache(maxsize=None)
def w8_weight(tp, mode):
    """The TP rank's bf16 weight as e4m3 + its canonical scale: [N] ("channel") or [N // 64, 64] ("block")."""
    from musekern.weights.pack import to_e4m3

    w = weight(tp).float()
    n = w.shape[0]
    s = w.abs().amax(1) / 448.0
    if mode == "block":
        s = s.reshape(n // D, D).amax(1)[:, None].expand(n // D, 64).contiguous()
    full = s[:, None] if mode == "channel" else s.repeat_interleave(D, 0).repeat_interleave(128, 1)
    return to_e4m3(w / full), s


def w8_front_args(c, mode, k_scale=None, v_scale=None):
    w, s = w8_weight(8, mode)
    return (c["x"], w, *front_args(c)[2:], k_scale, v_scale, s)


# opcheck's schema test compares EVERY input before and after with a float multiply, which torch's CPU float8
# tensors lack ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'), mutated or not: on CPU the e4m3 weight
# runs opcheck's other tests, and the schema's claim (weight and weight_scale read, not written) is checked bitwise
OPCHECK_BUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


# each granularity, both layouts, with bf16 caches and with FP8 (uint8) caches and their scales
@pytest.mark.parametrize("mode", ["channel", "block"])
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_opcheck_qkv_front_fp8_weight_cpu(mode, layout):
    c = case(layout=layout, pad=True)
    torch.library.opcheck(OPS.qkv_front.default, w8_front_args(c, mode), test_utils=OPCHECK_BUT_SCHEMA)
    c8 = fp8_case(layout)
    w, s = w8_weight(8, mode)
    args = fp8_front_args(c8, torch.uint8, k_scale=torch.tensor(0.5), v_scale=torch.tensor([2.0]))
    torch.library.opcheck(OPS.qkv_front.default, (args[0], w, *args[2:], s), test_utils=OPCHECK_BUT_SCHEMA)
    w0, s0 = w.view(torch.uint8).clone(), s.clone()
    OPS.qkv_front(args[0], w, *args[2:], s)
    assert torch.equal(w.view(torch.uint8), w0) and torch.equal(s, s0)


@pytest.mark.parametrize("mode", ["channel", "block"])
def test_fp8_weight_cpu_kernel_is_the_reference(mode):
    c = case(m=6, pad=True)
    want_kv = c["kv"].clone()
    a = w8_front_args(c, mode)
    want = qkv_front_reference(*w8_front_args({**c, "kv": want_kv}, mode)[:9], None, None, None, a[-1])
    got = OPS.qkv_front(*a)
    assert torch.equal(got, want) and torch.equal(c["kv"], want_kv)


def test_fp8_weight_fake_shape():
    s = SHARDS[8]
    y = fake_front(s, 40, weight_dtype=torch.float8_e4m3fn, extra=lambda s: (None, None, torch.empty(s.n // D, 64)))
    assert (tuple(y.shape), y.dtype) == ((40, s.n), torch.bfloat16)


class W8Ops(torch.nn.Module):
    """The op as an engine's compiled layer calls it with an FP8 checkpoint's weight and scale (graph inputs)."""

    def forward(self, x, weight, positions, cos_sin_cache, slot_mapping, kv, weight_scale):
        kc, vc = kv.unbind(0)
        return torch.ops.musekern.qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, kc, vc, kc.shape[2],
                                            EPS, weight_scale=weight_scale)


@pytest.mark.parametrize("mode", ["channel", "block"])
def test_fp8_weight_fullgraph_compile_matches_eager_bitwise(mode):
    mod = W8Ops()
    c = case(pad=True)
    w, s = w8_weight(8, mode)
    args = lambda kv: (c["x"], w, c["positions"], c["cos_sin_cache"], c["slot_mapping"], kv, s)  # noqa: E731
    explain = torch._dynamo.explain(mod)(*args(c["kv"].clone()))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    kv_eager = c["kv"].clone()
    want = mod(*args(kv_eager))
    got = torch.compile(mod, backend="aot_eager", fullgraph=True)(*args(c["kv"]))
    assert torch.equal(got, want) and torch.equal(c["kv"], kv_eager)
