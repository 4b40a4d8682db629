"""qkv_front op: the plain-torch reference against an independent fp64 computation (CPU), every
rejection of `unsupported` (CPU tensors), and the kernel against the reference (GPU, `gpu` mark).
"""
from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from musekern.config import load_config  # noqa: E402
from musekern.ops import qkv_front as op  # noqa: E402
from musekern.plan import plan_model  # noqa: E402
from musekern.reference import fused_qknorm_rope_kv_insert, qkv_front_reference, rope_cos_sin_table  # noqa: E402
from musekern.targets import get_target  # noqa: E402

K = 8192
D = 64
EPS = 1e-5


def test_rope_cos_sin_table_layout():
    """Row p = cos(p f_0..f_31) | sin(p f_0..f_31) with f_0 = 1 and f_31 = theta^(-62/64)."""
    t = rope_cos_sin_table(100, 10000.0)
    assert t.shape == (100, 64) and t.dtype == torch.float32
    assert torch.equal(t[0], torch.cat([torch.ones(32), torch.zeros(32)]))
    assert abs(t[7, 0].item() - math.cos(7)) < 1e-6 and abs(t[7, 32].item() - math.sin(7)) < 1e-6
    f31 = 10000.0 ** (-62 / 64)
    assert abs(t[99, 31].item() - math.cos(99 * f31)) < 1e-6 and abs(t[99, 63].item() - math.sin(99 * f31)) < 1e-6


def make_case(m=5, nkv=1, layout="vllm", num_blocks=6, block_size=4, max_pos=64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = 2 * (16 * nkv) + 2 * nkv
    n = heads * D
    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, K, generator=g) / math.sqrt(K)).to(torch.bfloat16)
    pos = torch.randint(0, max_pos, (m,), generator=g, dtype=torch.int64)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:m].to(torch.int64)
    if layout == "vllm":  # [2, blocks, block_size, nkv, 64]
        kv = torch.zeros(2, num_blocks, block_size, nkv, D, dtype=torch.bfloat16)
        kc, vc = kv[0], kv[1]
    else:  # flashinfer NHD [blocks, 2, block_size, nkv, 64]
        kv = torch.zeros(num_blocks, 2, block_size, nkv, D, dtype=torch.bfloat16)
        kc, vc = kv[:, 0], kv[:, 1]
    t = dict(x=x, weight=w, positions=pos, cos_sin_cache=rope_cos_sin_table(max_pos, 500000.0), slot_mapping=slots,
             key_cache=kc, value_cache=vc, num_kv_heads=nkv, eps=EPS)
    if device != "cpu":
        kv = kv.to(device)
        kc, vc = (kv[0], kv[1]) if layout == "vllm" else (kv[:, 0], kv[:, 1])
        t = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
        t["key_cache"], t["value_cache"] = kc, vc
    return t


def fp64_epilogue(yb, pos, cs, nkv, eps):
    """Independent fp64 loops: norm + interleaved RoPE of q/k heads (positions clamped), v/gate as is."""
    m, n = yb.shape
    heads = n // D
    nq = (heads - 2 * nkv) // 2
    y = yb.double()
    out = y.clone()
    csd = cs.double()
    for t in range(m):
        p = min(max(int(pos[t]), 0), cs.shape[0] - 1)
        for h in range(nq + nkv):
            v = y[t, h * D:(h + 1) * D]
            r = 1.0 / math.sqrt(float((v * v).sum()) / D + eps)
            for i in range(D // 2):
                a, b = float(v[2 * i]) * r, float(v[2 * i + 1]) * r
                c, s = float(csd[p, i]), float(csd[p, D // 2 + i])
                out[t, h * D + 2 * i] = a * c - b * s
                out[t, h * D + 2 * i + 1] = a * s + b * c
    return out


def assert_bf16_close(got, want64):
    """Within one bf16 rounding of the fp64 value (the fp32 path may round the other way at a tie)."""
    got = got.double()
    ulp = want64.abs().clamp_min(1e-30) * 2.0 ** -7
    bad = (got - want64).abs() > ulp + 1e-6
    assert not bad.any(), f"{int(bad.sum())} elements off by more than 1 bf16 ulp; worst " \
                          f"{float((got - want64).abs().max())}"


# ---------------------------------------------------------------- reference vs fp64
@pytest.mark.parametrize("nkv", [1, 2])
def test_epilogue_matches_fp64(nkv):
    c = make_case(m=3, nkv=nkv, seed=nkv)
    n = c["weight"].shape[0]
    yb = (torch.randn(3, n, generator=torch.Generator().manual_seed(7)) * 3).to(torch.bfloat16)
    kc, vc = c["key_cache"], c["value_cache"]
    y = fused_qknorm_rope_kv_insert(yb, c["positions"], c["cos_sin_cache"], c["slot_mapping"], kc, vc, nkv, EPS)
    assert y.dtype == torch.bfloat16 and y.shape == yb.shape
    assert_bf16_close(y, fp64_epilogue(yb, c["positions"], c["cos_sin_cache"], nkv, EPS))
    nq = (n // D - 2 * nkv) // 2
    assert torch.equal(y[:, (nq + nkv) * D:], yb[:, (nq + nkv) * D:])  # v and gate unchanged, bitwise


def test_reference_gemm_and_epilogue_match_fp64():
    c = make_case(m=5, nkv=1)
    y = qkv_front_reference(**c)
    y64 = c["x"].double() @ c["weight"].double().t()
    yb64 = y64.to(torch.bfloat16)  # the fp32-accumulated GEMM may round differently by one ulp
    n = y.shape[1]
    nq, nkv = 16, 1
    assert_bf16_close(y[:, (nq + nkv) * D:], y64[:, (nq + nkv) * D:])
    want = fp64_epilogue(yb64, c["positions"], c["cos_sin_cache"], nkv, EPS)
    # normed values: a one-ulp GEMM difference moves them by about one ulp too
    assert (y[:, :(nq + nkv) * D].double() - want[:, :(nq + nkv) * D]).abs().max() < 0.05
    assert y.shape == (5, n)


@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_cache_insert_and_padding(layout):
    c = make_case(m=4, nkv=2, layout=layout)
    cap = c["key_cache"].shape[0] * c["key_cache"].shape[1]
    c["slot_mapping"] = torch.tensor([5, -1, cap, 0], dtype=torch.int64)  # token 1 padding, token 2 out of range
    kbefore, vbefore = c["key_cache"].clone(), c["value_cache"].clone()
    y = qkv_front_reference(**c)
    nq, nkv = 32, 2
    bs = c["key_cache"].shape[1]
    k_cols = y[:, nq * D:(nq + nkv) * D].reshape(4, nkv, D)
    v_cols = y[:, (nq + nkv) * D:(nq + 2 * nkv) * D].reshape(4, nkv, D)
    for t, slot in ((0, 5), (3, 0)):
        assert torch.equal(c["key_cache"][slot // bs, slot % bs], k_cols[t])
        assert torch.equal(c["value_cache"][slot // bs, slot % bs], v_cols[t])
    touched = torch.zeros_like(kbefore, dtype=torch.bool)
    for slot in (5, 0):
        touched[slot // bs, slot % bs] = True
    assert torch.equal(c["key_cache"][~touched], kbefore[~touched])
    assert torch.equal(c["value_cache"][~touched], vbefore[~touched])


def test_positions_are_clamped():
    c = make_case(m=3)
    max_pos = c["cos_sin_cache"].shape[0]
    c["positions"] = torch.tensor([-7, max_pos + 3, 2], dtype=torch.int64)
    y = qkv_front_reference(**c)
    c2 = make_case(m=3)
    c2["positions"] = torch.tensor([0, max_pos - 1, 2], dtype=torch.int64)
    assert torch.equal(y, qkv_front_reference(**c2))


def test_out_argument():
    c = make_case(m=2)
    out = torch.empty(2, c["weight"].shape[0], dtype=torch.bfloat16)
    y = qkv_front_reference(**c, out=out)
    assert y is out and torch.equal(out, qkv_front_reference(**make_case(m=2)))


# ---------------------------------------------------------------- unsupported (CPU tensors)
def test_valid_cpu_call_only_lacks_a_gpu():
    c = make_case()
    r = op.unsupported(**c)
    assert r is not None and "CUDA" in r
    assert op.hidden_rows_ok(c["x"])
    assert op.kv_cache_layout_ok(c["key_cache"], c["value_cache"], 1)


def _mut(case=None, **changes):
    """A call's arguments (`case()`, default make_case) with `changes` applied (a value, or a function of the case)."""
    c = (case or make_case)()
    for k, f in changes.items():
        c[k] = f(c) if callable(f) else f
    return c


REJECT = {
    "x dtype": (dict(x=lambda c: c["x"].float()), "x.dtype"),
    "x not a tensor": (dict(x=[1, 2]), "x must be a torch.Tensor"),
    "x 1-D": (dict(x=lambda c: c["x"][0]), "x must be [M, 8192]"),
    "x hidden": (dict(x=lambda c: c["x"][:, :4096]), "x must be [M, 8192]"),
    "M = 0": (dict(x=lambda c: c["x"][:0]), "x must have at least one row (M >= 1)"),
    "M = 17, 5 positions": (dict(x=lambda c: torch.zeros(17, K, dtype=torch.bfloat16)), "positions must be [M=17]"),
    "x strided": (dict(x=lambda c: torch.zeros(5, 2 * K, dtype=torch.bfloat16)[:, ::2]),
                  "x must be row-major contiguous"),
    "x misaligned": (dict(x=lambda c: torch.zeros(5 * K + 1, dtype=torch.bfloat16)[1:].view(5, K)), "aligned"),
    "weight dtype": (dict(weight=lambda c: c["weight"].half()), "weight.dtype"),
    "weight K": (dict(weight=lambda c: c["weight"][:, :128]), "weight must be [N, 8192]"),
    "weight transposed": (dict(weight=lambda c: torch.zeros(K, 2176, dtype=torch.bfloat16).t()), "row-major"),
    "N not heads": (dict(weight=lambda c: c["weight"][:100]), "N=100"),
    "N vs kv heads": (dict(num_kv_heads=3), "num_kv_heads=3"),
    "kv heads type": (dict(num_kv_heads=1.0), "num_kv_heads must be an int"),
    "positions dtype": (dict(positions=lambda c: c["positions"].int()), "positions.dtype"),
    "positions length": (dict(positions=lambda c: c["positions"][:2]), "positions must be [M=5]"),
    "slots dtype": (dict(slot_mapping=lambda c: c["slot_mapping"].int()), "slot_mapping.dtype"),
    "slots 2-D": (dict(slot_mapping=lambda c: c["slot_mapping"][None]), "slot_mapping must be [M=5]"),
    "slots strided": (dict(slot_mapping=lambda c: torch.zeros(10, dtype=torch.int64)[::2]), "contiguous"),
    "cos_sin dtype": (dict(cos_sin_cache=lambda c: c["cos_sin_cache"].double()), "cos_sin_cache.dtype"),
    "cos_sin width": (dict(cos_sin_cache=lambda c: c["cos_sin_cache"][:, :32]), "cos_sin_cache must be"),
    "cos_sin strided": (dict(cos_sin_cache=lambda c: torch.zeros(64, 128)[:, ::2]), "cos_sin_cache must be contig"),
    "cache dtype": (dict(key_cache=lambda c: c["key_cache"].float()), "key_cache.dtype"),
    "cache heads": (dict(value_cache=lambda c: torch.zeros(6, 4, 2, 64, dtype=torch.bfloat16)), "value_cache must"),
    "cache head dim": (dict(key_cache=lambda c: torch.zeros(6, 4, 1, 128, dtype=torch.bfloat16)), "key_cache must"),
    "cache HND": (dict(key_cache=lambda c: torch.zeros(6, 1, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
                       .expand(6, 4, 1, 64).contiguous().as_strided((6, 4, 1, 64), (256, 1, 256, 4))),
                  "inner three dims"),
    "cache shapes differ": (dict(value_cache=lambda c: torch.zeros(7, 4, 1, 64, dtype=torch.bfloat16)), "differ"),
    "cache overlapping blocks": (dict(key_cache=lambda c: torch.zeros(2000, dtype=torch.bfloat16)
                                      .as_strided((6, 4, 1, 64), (64, 64, 64, 1))), "block stride"),
    # issue 29: inductor hands `kv.view(float8).unbind(0)` of one uint8 cache to the op as one buffer twice (seen on
    # the H200: k and v then overwrite each other); any two caches at one address are refused
    "caches are one memory": (dict(value_cache=lambda c: c["key_cache"]), "the same memory"),
    "eps": (dict(eps=float("nan")), "eps"),
    "out shape": (dict(out=lambda c: torch.empty(5, 64, dtype=torch.bfloat16)), "out must be"),
    "out dtype": (dict(out=lambda c: torch.empty(5, 2176, dtype=torch.float32)), "out must be"),
    "out strided": (dict(out=lambda c: torch.empty(5, 4352, dtype=torch.bfloat16)[:, ::2]), "contiguous"),
    "out overlaps x": (dict(out=lambda c: c["x"].view(-1)[:5 * 2176].view(5, 2176)), "overlap"),
}


@pytest.mark.parametrize("name", sorted(REJECT))
def test_unsupported_rejects(name):
    changes, reason = REJECT[name]
    c = _mut(**changes)
    r = op.unsupported(**c)
    assert r is not None and reason in r, r
    with pytest.raises((TypeError, ValueError), match="qkv_front"):
        op.qkv_front(**c)


# every rejection, and calls the reasons reject only after a cheap look (a 3-D x of the right row width, a weight of
# the right width but another rank: the fast path must still refuse them)
FAST_REJECT = {**{k: v[0] for k, v in REJECT.items()},
               "x 3-D": dict(x=lambda c: torch.zeros(5, K, 2, dtype=torch.bfloat16)),
               "weight 3-D": dict(weight=lambda c: torch.zeros(2176, K, 1, dtype=torch.bfloat16)),
               "cos_sin 1-D": dict(cos_sin_cache=lambda c: torch.zeros(64 * 64)),
               "cache 5-D": dict(key_cache=lambda c: c["key_cache"][None],
                                 value_cache=lambda c: c["value_cache"][None]),
               "out 1-D": dict(out=lambda c: torch.empty(5 * 2176, dtype=torch.bfloat16)),
               "eps int": dict(eps=0), "kv heads bool": dict(num_kv_heads=True)}


@pytest.mark.parametrize("name", sorted(FAST_REJECT))
def test_fast_path_never_accepts_a_rejected_call(as_if_cuda, name):
    """The fast path (checks reading each attribute once, the host cost) is stricter than the reasons."""
    c = _mut(**FAST_REJECT[name])
    assert op._fast(**{**c, "out": c.get("out")}, dry=True) is None


@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_fast_path_accepts_the_common_call(as_if_cuda, layout, m):
    c = make_case(m=m, layout=layout)
    assert op._fast(**c, out=None, dry=True)
    assert op._fast(**c, out=torch.empty(m, c["weight"].shape[0], dtype=torch.bfloat16), dry=True)
    assert op.unsupported(**c) is None


def _map_key(t):
    """The tensor-map cache key the loader reads from a tensor (runtime/tensormap.py TensorMaps.encode)."""
    return (t.data_ptr(), t.shape[0], t.shape[1], t.stride(0))


# both layouts, M at the front's edges, `out` given or allocated: the checked call launches exactly the values the
# unchecked binding (launch_args) gives, its tensor maps as the keys the loader would read from the tensors
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("give_out", [False, True])
def test_the_checked_call_launches_the_values_it_checked(as_if_cuda, recorder, monkeypatch, layout, m, give_out):
    rec = recorder
    monkeypatch.setattr(op, "_RUNS", op.Plans(lambda n, m, nkv, dev: rec))
    c = make_case(m=m, layout=layout)
    out = torch.empty(m, 2176, dtype=torch.bfloat16) if give_out else None
    y = op.qkv_front(**c, out=out)
    assert (y is out) if give_out else (y.shape == (m, 2176) and y.dtype == torch.bfloat16)
    want = op.launch_args(c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"],
                          c["key_cache"], c["value_cache"], EPS, y)
    want["weight"], want["x"] = _map_key(c["weight"]), _map_key(c["x"])
    assert len(rec.calls) == 1 and dict(zip(op._NAMES, rec.calls[0], strict=True)) == want
    assert list(op._RUNS) == [(2176, m, 1, 0)]


def test_the_gemm_path_launches_the_epilogue_with_the_values_checked(as_if_cuda, recorder, monkeypatch):
    """Above the front's M: torch.mm into y, then the epilogue's launcher with the values the front's checks read
    (nothing re-read, nothing re-checked)."""
    rec = recorder
    monkeypatch.setattr(op, "_RUNS", op.Plans(lambda n, m, nkv, dev: op._GEMM))
    monkeypatch.setattr(op.qkv_epilogue, "_RUNS", op.Plans(lambda n, m, nkv, dev: rec))
    c = make_case(m=40, num_blocks=16)
    y = op.qkv_front(**c)
    assert torch.equal(y, c["x"] @ c["weight"].t())  # the mm ran (CPU); the epilogue's launch was recorded
    want = op.qkv_epilogue.launch_args(y, c["positions"], c["cos_sin_cache"], c["slot_mapping"], c["key_cache"],
                                       c["value_cache"], 1, EPS)
    assert len(rec.calls) == 1 and dict(zip(op.qkv_epilogue._NAMES, rec.calls[0], strict=True)) == want


def test_type_errors_vs_value_errors():
    with pytest.raises(TypeError):
        op.qkv_front(**_mut(x=lambda c: c["x"].float()))
    with pytest.raises(ValueError):
        op.qkv_front(**make_case())  # CPU tensors: valid shapes, no GPU


def test_hidden_rows_ok():
    x = torch.zeros(3, K, dtype=torch.bfloat16)
    assert op.hidden_rows_ok(x)
    assert not op.hidden_rows_ok(x.float())
    assert op.hidden_rows_ok(torch.zeros(17, K, dtype=torch.bfloat16))  # every M >= 1 (front or GEMM + epilogue)
    assert not op.hidden_rows_ok(torch.zeros(0, K, dtype=torch.bfloat16))
    assert not op.hidden_rows_ok(torch.zeros(3, 2 * K, dtype=torch.bfloat16)[:, :K])
    assert not op.hidden_rows_ok("x")


def test_kv_cache_layout_ok():
    kv = torch.zeros(2, 6, 4, 2, 64, dtype=torch.bfloat16)
    assert op.kv_cache_layout_ok(kv[0], kv[1], 2)
    fi = torch.zeros(6, 2, 4, 2, 64, dtype=torch.bfloat16)
    assert op.kv_cache_layout_ok(fi[:, 0], fi[:, 1], 2)
    assert not op.kv_cache_layout_ok(kv[0], kv[1], 1)
    assert not op.kv_cache_layout_ok(kv[0].transpose(1, 2), kv[1].transpose(1, 2), 2)
    assert not op.kv_cache_layout_ok(kv[0], kv[1], True)


def test_auto_falls_back_to_reference_on_cpu():
    y = op.qkv_front_auto(**make_case())
    assert torch.equal(y, qkv_front_reference(**make_case()))


def test_launch_args_cover_the_abi():
    c = make_case()
    out = torch.empty(5, 2176, dtype=torch.bfloat16)
    args = op.launch_args(c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"],
                          c["key_cache"], c["value_cache"], EPS, out)
    assert args["k_block_stride"] == c["key_cache"].stride(0) == 2 * 6 * 0 + 4 * 64  # vLLM split: blocks contiguous
    assert args["M"] == 5 and args["max_pos"] == 64 and args["block_size"] == 4 and args["num_blocks"] == 6
    try:
        from musekern.kernels.qkv_front.abi import abi_for
    except ImportError:
        pytest.skip("cutlass not installed")
    from musekern.kernels.qkv_front.variant import QkvFrontVariant

    for fixed in (0, 8):
        abi = abi_for(QkvFrontVariant(2176, 1, 1, 8, 2, fixed))
        maps = {s.param for s in abi.tensormaps}
        need = {f.name for p in abi.params for f in p.fields} - maps
        assert need <= set(args), need - set(args)
        assert {s.tensor for s in abi.tensormaps} <= set(args)


def test_the_op_hands_out_no_compiler():
    """The op module is the serving leg: the compiler is the builder's (musekern.builder.compile.compile_variant)."""
    assert not hasattr(op, "compile_qkv_front") and not hasattr(op, "QkvFrontKernel")


# The kernel on the GPU (every M and N, caches, determinism, ring depth, graphs, PDL) is tested in
# tests/test_gpu_qkv_front.py against an fp64 pipeline with the error bound.


# every planned variant (tiles 1 and 2, the M == 8 build, each PDL trigger and warp split the plan uses): the
# op binds each build's ABI by its parameter names, in the order the loader packs them
@pytest.mark.parametrize("v", [e.variant for e in plan_model(load_config(), [get_target("h200")])
                               if e.kernel == "qkv_front"], ids=lambda v: v.label)
def test_op_binds_every_planned_abi_by_name(v):
    from musekern.kernels.qkv_front.abi import abi_for
    from musekern.ops._bind import take
    from musekern.runtime.loader import _ParamBlock

    abi = abi_for(v)
    names = tuple(_ParamBlock(abi.params, abi.tensormaps).names)
    c = make_case()
    out = torch.empty(5, 2176, dtype=torch.bfloat16)
    call = (c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"], c["key_cache"],
            c["value_cache"], EPS, out)
    values = op._all_values(*call)
    by_name = op.launch_args(*call)
    picked = [values[i] for i in take(v.label, names, op._NAMES)]
    assert all(val is by_name[n] or val == by_name[n] for n, val in zip(names, picked, strict=True))


@pytest.mark.parametrize("v", [dataclasses.replace(e.variant, kv_cache_dtype="fp8_e4m3")
                               for e in plan_model(load_config(), [get_target("h200")]) if e.kernel == "qkv_front"],
                         ids=lambda v: v.label)
def test_op_binds_every_planned_fp8_abi_by_name(v):
    """The FP8 builds: the bf16 build's values, then the scales' (a tensor's address, a float's value)."""
    pytest.importorskip("cutlass")
    from musekern.kernels.qkv_front import abi_for
    from musekern.ops._bind import take
    from musekern.runtime.loader import _ParamBlock

    abi = abi_for(v)
    names = tuple(_ParamBlock(abi.params, abi.tensormaps).names)
    c = fp8_case()
    ks = torch.tensor(0.5)
    call = (c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"], c["key_cache"],
            c["value_cache"], EPS, torch.empty(5, 2176, dtype=torch.bfloat16), ks, 0.25)
    values = op._fp8_values(*call)
    by_name = op.launch_args(*call)
    picked = [values[i] for i in take(v.label, names, op._NAMES_FP8)]
    assert all(val is by_name[n] or val == by_name[n] for n, val in zip(names, picked, strict=True))
    assert names[-4:] == ("k_scale_ptr", "k_scale", "v_scale_ptr", "v_scale")
    assert picked[-4:] == [ks.data_ptr(), 1.0, 0, 0.25]


def test_a_parameter_the_op_cannot_bind_names_the_fix():
    from musekern.ops._bind import UnboundParameterError, binder, take

    with pytest.raises(UnboundParameterError, match=r"takes new_thing.*musekern prepare"):
        binder("qkv_front[...]", ("x", "new_thing"), op._VALUES, op._ARGS)
    with pytest.raises(UnboundParameterError, match=r"takes new_thing.*musekern prepare"):
        take("qkv_front[...]", ("x", "new_thing"), op._NAMES)


# ---------------------------------------------------------------- every M: the two GPU paths (plumbing, on CPU)
def test_auto_is_the_reference_on_cpu_at_every_m():
    for m in (1, 17, 40):
        c = make_case(m=m, num_blocks=16)
        assert torch.equal(op.qkv_front_auto(**c), qkv_front_reference(**make_case(m=m, num_blocks=16)))


# TP8 / TP4 take the fused front up to M = 64, TP2 up to 48 (one wave at two CTAs per SM; 8 tiles without a cluster
# lose to cuBLAS), TP1 only up to 16; every other M takes the GEMM + epilogue (variants.front_serves, measured:
# bench/NOTES.md "Every M: which path"). The grid: each side of every tile boundary and of the served range.
@pytest.mark.parametrize("n,fused_up_to", [(2176, 64), (4352, 64), (8704, 48), (17408, 16)])
def test_the_path_follows_the_planner(monkeypatch, n, fused_up_to):
    monkeypatch.setattr(op, "_target", lambda dev: get_target("h200"))
    op._fused.cache_clear()
    ms = (1, 8, 16, 17, 32, 33, 48, 49, 64, 65, 4096)
    try:
        assert [m for m in ms if op._fused(n, m, 0)] == [m for m in ms if m <= fused_up_to]
    finally:
        op._fused.cache_clear()


def test_gemm_epilogue_path_is_mm_then_the_epilogue_in_place(monkeypatch):
    """launch_gemm_epilogue = torch.mm into out, then the epilogue on out (here the reference's, in place)."""
    calls = []

    def epilogue(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps, **scales):
        calls.append(y.data_ptr())
        y.copy_(fused_qknorm_rope_kv_insert(y, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                                            num_kv_heads, eps))
        return y

    monkeypatch.setattr(op.qkv_epilogue, "launch", epilogue)
    c = make_case(m=40, num_blocks=16)
    out = torch.empty(40, c["weight"].shape[0], dtype=torch.bfloat16)
    y = op.launch_gemm_epilogue(**c, out=out)
    ref = make_case(m=40, num_blocks=16)
    assert y is out and calls == [out.data_ptr()]
    # torch.mm's CPU summation order differs from the reference's float GEMM: equal to a bf16 rounding step
    assert torch.allclose(y.float(), qkv_front_reference(**ref).float(), rtol=2 ** -7, atol=2 ** -7)
    assert torch.equal(c["key_cache"] != 0, ref["key_cache"] != 0)  # the same slots written


def test_prepare_without_cuda_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"no CUDA device is visible to torch .* `musekern prepare`"):
        op.prepare(2176)


# byte ranges before, inside, across and after each cache (both layouts: the block stride decides where a cache
# ends), and exactly adjacent: the fast path's overlap test must agree with the general span test
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_the_fast_overlap_test_is_the_general_one(layout):
    from musekern.ops.checks import fast_token_cache_values, span

    c = make_case(layout=layout)
    tok = (c["positions"], c["slot_mapping"], c["cos_sin_cache"], c["key_cache"], c["value_cache"])
    spans = [span(c["key_cache"]), span(c["value_cache"])]
    base, total = c["key_cache"].untyped_storage().data_ptr(), c["key_cache"].untyped_storage().nbytes()
    for start in range(-256, total + 256, 64):
        for length in (2, 128, 4096):
            a0, a1 = base + start, base + start + length
            meets = any(a0 < c1 and c0 < a1 for c0, c1 in spans)
            # device -1: these CPU tensors' get_device()
            assert (fast_token_cache_values(5, -1, 1, *tok, a0, a1) is None) == meets, (start, length)


def test_the_cache_layout_verdict_is_kept_per_layout(monkeypatch):
    """The layout rules run once per (shapes, strides, num_kv_heads); addresses are checked on every call; the
    verdicts are bounded."""
    from musekern.ops import checks

    monkeypatch.setattr(checks, "_LAYOUTS", {})
    runs = []
    rules = checks._layout
    monkeypatch.setattr(checks, "_layout", lambda *k: runs.append(k) or rules(*k))
    c = make_case()
    tok = (c["positions"], c["slot_mapping"], c["cos_sin_cache"], c["key_cache"], c["value_cache"])
    got = checks.fast_token_cache_values(5, -1, 1, *tok)
    ptrs = (c[k].data_ptr() for k in ("positions", "cos_sin_cache", "slot_mapping", "key_cache", "value_cache"))
    assert got == (*ptrs, 64, 4, 6, c["key_cache"].stride(0), c["value_cache"].stride(0))  # the ABI's order
    assert checks.fast_token_cache_values(5, -1, 1, *tok) == got and len(runs) == 1
    other = make_case(layout="flashinfer")  # same shapes, other block strides: its own verdict
    assert checks.fast_token_cache_values(5, -1, 1, *tok[:3], other["key_cache"], other["value_cache"]) is not None
    assert len(runs) == 2
    misaligned = torch.zeros(6 * 4 * D + 8, dtype=torch.bfloat16)[4:4 + 6 * 4 * D].view(6, 4, 1, D)
    assert checks.fast_token_cache_values(5, -1, 1, *tok[:3], misaligned, c["value_cache"]) is None  # same layout
    assert len(runs) == 2 and checks.fast_token_cache_values(5, -1, 1, *tok) == got  # the verdict, not the address
    assert checks.fast_token_cache_values(5, 0, 1, *tok) is None  # another device
    for nb in range(300):  # a new layout each: the dict starts over past 256
        kv = torch.zeros(2, nb + 1, 4, 1, D, dtype=torch.bfloat16)
        checks.fast_token_cache_values(5, -1, 1, *tok[:3], kv[0], kv[1])
    assert len(checks._LAYOUTS) <= 256


# ---------------------------------------------------------------- FP8 KV caches (issue 29), on CPU
def fp8_case(m=5, layout="vllm", dtype=torch.uint8, **kw):
    """make_case with FP8 caches (float8_e4m3fn or uint8) of the same layout and shape."""
    from kv_layouts import paged_caches

    c = make_case(m=m, layout=layout, **kw)
    kc = c["key_cache"]
    c["key_cache"], c["value_cache"], _ = paged_caches(kc.shape[0], kc.shape[1], kc.shape[2], layout, dtype=dtype)
    return c


# one line each: a cache dtype not served (e5m2 says so), caches of two dtypes, each wrong scale
REJECT_FP8 = {
    "e5m2 cache": (dict(key_cache=lambda c: c["key_cache"].view(torch.float8_e5m2),
                        value_cache=lambda c: c["value_cache"].view(torch.float8_e5m2)), "fp8_e5m2 KV caches are not"),
    "fp16 cache": (dict(key_cache=lambda c: torch.zeros(6, 4, 1, 64, dtype=torch.float16)), "float8_e4m3fn / uint8"),
    "bf16 key, fp8 value": (dict(key_cache=lambda c: torch.zeros(6, 4, 1, 64, dtype=torch.bfloat16)), "differ"),
    "uint8 key, float8 value": (dict(value_cache=lambda c: c["value_cache"].view(torch.float8_e4m3fn)), "differ"),
    "k_scale float64": (dict(k_scale=torch.tensor(1.0, dtype=torch.float64)), "k_scale.dtype must be float32"),
    "v_scale bf16": (dict(v_scale=torch.tensor([1.0], dtype=torch.bfloat16)), "v_scale.dtype must be float32"),
    "k_scale two values": (dict(k_scale=torch.ones(2)), "k_scale must be a 0-dim or 1-element tensor"),
    "v_scale empty": (dict(v_scale=torch.ones(0)), "v_scale must be a 0-dim or 1-element tensor"),
    "k_scale str": (dict(k_scale="1.0"), "k_scale must be a float or a one-element float32 tensor"),
    "k_scale bool": (dict(k_scale=True), "k_scale must be a float"),
    "k_scale zero": (dict(k_scale=0.0), "k_scale must be a finite float > 0"),
    "v_scale negative": (dict(v_scale=-0.5), "v_scale must be a finite float > 0"),
    "v_scale inf": (dict(v_scale=float("inf")), "v_scale must be a finite float > 0"),
    "k_scale nan": (dict(k_scale=float("nan")), "k_scale must be a finite float > 0"),
    "k_scale below float32": (dict(k_scale=1e-46), "k_scale must be a float32 scale"),  # 0 as a float32
    "v_scale above float32": (dict(v_scale=1e39), "v_scale must be a float32 scale"),  # inf as a float32
}


@pytest.mark.parametrize("name", sorted(REJECT_FP8))
def test_fp8_unsupported_rejects(name):
    changes, reason = REJECT_FP8[name]
    c = _mut(fp8_case, **changes)
    r = op.unsupported(**c)
    assert r is not None and reason in r and "\n" not in r, r
    with pytest.raises((TypeError, ValueError), match="qkv_front"):
        op.qkv_front(**c)
    assert not op._fast(**{**c, "out": None}, dry=True)


def test_fp8_scale_on_another_device_is_named(as_if_cuda):
    c = {**fp8_case(), "out": None}
    assert "k_scale is on meta, x on cpu" in op._reason(**c, k_scale=torch.tensor(0.5, device="meta"))
    s = torch.tensor(0.5)
    s.get_device = lambda: 1  # a scale on CUDA device 1, the call on device 0: the fast path leaves it to the reasons
    assert op._fast(**fp8_case(), out=None, dry=True, v_scale=s) is None


def test_kv_cache_layout_ok_takes_fp8_caches():
    for dtype in (torch.uint8, torch.float8_e4m3fn):
        c = fp8_case(dtype=dtype, nkv=2)
        assert op.kv_cache_layout_ok(c["key_cache"], c["value_cache"], 2)
    assert not op.kv_cache_layout_ok(fp8_case()["key_cache"].view(torch.float8_e5m2),
                                     fp8_case()["value_cache"].view(torch.float8_e5m2), 1)


SCALES = {"none": (None, None), "floats": (0.25, 3.0), "tensors": (torch.tensor(0.25), torch.tensor([3.0])),
          "mixed": (torch.tensor(0.25), 3.0)}


# both layouts, both FP8 dtypes, every kind of scale: the fast path takes the call, and the checked call launches
# the FP8 build's plan with the values the unchecked binding gives (the scales as address 0 + value, or address)
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn], ids=["uint8", "float8_e4m3fn"])
@pytest.mark.parametrize("scales", sorted(SCALES))
def test_fp8_checked_call_launches_the_fp8_plan_with_the_scales(as_if_cuda, recorder, monkeypatch, layout, dtype,
                                                                 scales):
    rec = recorder
    monkeypatch.setattr(op, "_RUNS", op.Plans(lambda n, m, nkv, dev: pytest.fail("the bf16 plan")))
    monkeypatch.setattr(op, "_RUNS_FP8", op.Plans(lambda n, m, nkv, dev: rec))
    ks, vs = SCALES[scales]
    c = fp8_case(layout=layout, dtype=dtype)
    assert op._fast(**c, out=None, dry=True, k_scale=ks, v_scale=vs)
    y = op.qkv_front(**c, k_scale=ks, v_scale=vs)
    want = op.launch_args(c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"],
                          c["key_cache"], c["value_cache"], EPS, y, ks, vs)
    want["weight"], want["x"] = _map_key(c["weight"]), _map_key(c["x"])
    got = dict(zip(op._NAMES_FP8, rec.calls[0], strict=True))
    assert len(rec.calls) == 1 and got == want
    for s, p, v in ((ks, "k_scale_ptr", "k_scale"), (vs, "v_scale_ptr", "v_scale")):
        assert (got[p], got[v]) == ((s.data_ptr(), 1.0) if isinstance(s, torch.Tensor) else (0, s or 1.0))


def test_fp8_gemm_path_launches_the_fp8_epilogue_with_the_scales(as_if_cuda, recorder, monkeypatch):
    rec = recorder
    monkeypatch.setattr(op, "_RUNS_FP8", op.Plans(lambda n, m, nkv, dev: op._GEMM))
    monkeypatch.setattr(op.qkv_epilogue, "_RUNS_FP8", op.Plans(lambda n, m, nkv, dev: rec))
    c = fp8_case(m=40, num_blocks=16)
    ks = torch.tensor(0.5)
    y = op.qkv_front(**c, k_scale=ks, v_scale=2.0)
    want = op.qkv_epilogue.launch_args(y, c["positions"], c["cos_sin_cache"], c["slot_mapping"], c["key_cache"],
                                       c["value_cache"], 1, EPS, ks, 2.0)
    assert len(rec.calls) == 1 and dict(zip(op.qkv_epilogue._NAMES_FP8, rec.calls[0], strict=True)) == want
    assert want["k_scale_ptr"] == ks.data_ptr() and want["v_scale"] == 2.0


def test_bf16_caches_take_the_bf16_plan_and_accept_scales(as_if_cuda, recorder, monkeypatch):
    """vLLM passes its layers' scales whatever the cache: a bf16 cache ignores them (the bf16 build has no such
    parameter), and its fast path stays the one of a call without them."""
    rec = recorder
    monkeypatch.setattr(op, "_RUNS", op.Plans(lambda n, m, nkv, dev: rec))
    monkeypatch.setattr(op, "_RUNS_FP8", op.Plans(lambda n, m, nkv, dev: pytest.fail("the fp8 plan")))
    c = make_case()
    op.qkv_front(**c, k_scale=torch.tensor(2.0), v_scale=0.5)
    op.qkv_front(**c)
    assert len(rec.calls) == 2


def test_fp8_auto_on_cpu_is_the_reference_with_the_scales():
    from musekern.reference import e4m3_rows

    for dtype in (torch.uint8, torch.float8_e4m3fn):
        c8, c16 = fp8_case(dtype=dtype), make_case()
        y8 = op.qkv_front_auto(**c8, k_scale=torch.tensor(0.5), v_scale=0.125)
        y16 = op.qkv_front_auto(**c16)
        assert torch.equal(y8, y16)
        for cache8, cache16, s in ((c8["key_cache"], c16["key_cache"], 0.5), (c8["value_cache"],
                                                                              c16["value_cache"], 0.125)):
            written = (cache16 != 0).any(-1).any(-1)  # the bf16 run's written slots (inputs are nonzero there)
            assert torch.equal(cache8.view(torch.uint8)[written], e4m3_rows(cache16[written], s).view(torch.uint8))


# ---------------------------------------------------------------- FP8 weights (issue 30), on CPU
def w8_case(mode="channel", m=5, case=None, **kw):
    """A call with an e4m3 weight (`case`'s bf16 one quantized per row) and its canonical scale: [N] ("channel") or
    [N // 64, 64] ("block"; the per-row scales spread over each 64-row group's 64 K blocks, values that differ)."""
    c = (case or make_case)(m=m, **kw)
    w = c["weight"].float()
    n = w.shape[0]
    s = (w.abs().amax(1) / 448.0).clamp_min(2.0 ** -20)
    if mode == "block":
        s = (s.reshape(n // D, D).amax(1)[:, None] * torch.linspace(1.0, 2.0, 64)[None, :]).contiguous()
    from musekern.weights.pack import to_e4m3

    full = s[:, None] if mode == "channel" else s.repeat_interleave(D, 0).repeat_interleave(128, 1)
    c["weight"], c["weight_scale"] = to_e4m3(w / full), s
    return c


def _e4m3(c):
    return c["weight"].float().to(torch.float8_e4m3fn)


# one line each, with the exception class `raise_for` gives it: the pairing of weight and scale, each of the scale's
# rules (type, dtype, shape of either granularity, contiguity, alignment), the FP8 weight dtypes not served
REJECT_W8 = {
    "e4m3 weight without scale": (dict(weight_scale=None), "weight is float8_e4m3fn without its weight_scale",
                                  ValueError),
    "bf16 weight with scale": (dict(weight=lambda c: make_case()["weight"]),
                               "weight_scale goes with a float8_e4m3fn weight only", ValueError),
    "scale a float": (dict(weight_scale=1.0), "weight_scale must be a torch.Tensor", TypeError),
    "scale bf16": (dict(weight_scale=lambda c: c["weight_scale"].bfloat16()), "weight_scale.dtype must be float32",
                   TypeError),
    "scale [N, 1]": (dict(weight_scale=lambda c: c["weight_scale"][:, None]),
                     "weight_scale must be [N=2176] (one per row) or [34, 64]", ValueError),
    "scale [N/128, 64]": (dict(weight_scale=lambda c: torch.ones(17, 64)), "got shape (17, 64)", ValueError),
    "scale strided": (dict(weight_scale=lambda c: torch.ones(2 * 2176)[::2]), "weight_scale must be contiguous",
                      ValueError),
    "scale misaligned": (dict(weight_scale=lambda c: torch.ones(2176 + 1)[1:]), "weight_scale must be 16-byte aligned",
                         ValueError),
    "e5m2 weight": (dict(weight=lambda c: c["weight"].float().to(torch.float8_e5m2)),
                    "e5m2 weights are not served", TypeError),
    "uint8 weight": (dict(weight=lambda c: c["weight"].view(torch.uint8)), "weight.view(torch.float8_e4m3fn)",
                     TypeError),
    "e4m3 weight K": (dict(weight=lambda c: c["weight"][:, :4096]), "weight must be [N, 8192]", ValueError),
}


@pytest.mark.parametrize("name", sorted(REJECT_W8))
def test_fp8_weight_rejects(name):
    changes, reason, exc = REJECT_W8[name]
    c = _mut(w8_case, **changes)
    r = op.unsupported(**c)
    assert r is not None and reason in r and "\n" not in r, r
    with pytest.raises(exc, match="qkv_front: "):
        op.qkv_front(**c)


@pytest.mark.parametrize("name", sorted(REJECT_W8))
def test_fp8_weight_fast_path_never_accepts_a_rejected_call(as_if_cuda, name):
    c = _mut(w8_case, **REJECT_W8[name][0])
    assert op._fast(**{**c, "out": None}, dry=True) is None


def test_fp8_weight_scale_on_another_device_is_named(as_if_cuda):
    c = {**w8_case(), "out": None}
    assert "weight_scale is on meta, x on cpu" in op._reason(**{**c, "weight_scale": torch.ones(2176, device="meta")})
    s = torch.ones(2176)
    s.get_device = lambda: 1  # on CUDA device 1, the call on device 0: the fast path leaves it to the reasons
    assert op._fast(**{**c, "weight_scale": s}, dry=True) is None


# each granularity x both cache layouts x bf16 / FP8 caches x M at the front's edges (1, 16) and above (17, the GEMM
# path): the fast path takes the call, and the checked call runs the plan table of its (cache dtype, granularity)
# with the values the unchecked binding gives, the scale's address in the weight_scale slot
@pytest.mark.parametrize("mode", ["channel", "block"])
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_weight_checked_call_launches_its_plan(as_if_cuda, recorder, monkeypatch, mode, layout, kv, m):
    rec = recorder
    kvd = "bf16" if kv == "bf16" else "fp8_e4m3"
    for table in ("_RUNS", "_RUNS_FP8"):
        monkeypatch.setattr(op, table, op.Plans(lambda *k: pytest.fail("a bf16 weight's plan")))
    monkeypatch.setattr(op, "_RUNS_W8", {key: op.Plans(lambda *k, key=key: rec if key == (kvd, mode) else
                                                       pytest.fail(f"the {key} plan")) for key in op._RUNS_W8})
    c = w8_case(mode, m=m, case=make_case if kv == "bf16" else fp8_case, layout=layout, num_blocks=16)
    assert op._fast(**c, out=None, dry=True)
    y = op.qkv_front(**c, k_scale=0.5)
    want = op.launch_args(c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"],
                          c["key_cache"], c["value_cache"], EPS, y, 0.5, None, c["weight_scale"])
    names = op._NAMES_W8 if kv == "bf16" else op._NAMES_W8_FP8
    assert "weight_ptr" not in want and want["weight_scale"] == c["weight_scale"].data_ptr()
    want["weight"], want["x"] = _map_key(c["weight"]), _map_key(c["x"])
    assert len(rec.calls) == 1 and dict(zip(names, rec.calls[0], strict=True)) == want
    # the unchecked launch takes the same table and values (the tensor maps' tensors themselves)
    op.launch(**c, out=y, k_scale=0.5)
    assert rec.calls[1][0] is c["weight"] and rec.calls[1][1] is c["x"] and rec.calls[1][2:] == rec.calls[0][2:]


@pytest.mark.parametrize("mode", ["channel", "block"])
def test_fp8_weight_gemm_path_is_gemm_fp8_then_the_epilogue(as_if_cuda, recorder, monkeypatch, mode):
    """Above the FP8 front's M: gemm.fp8.mm into y (CPU here: torch's own _scaled_mm / mm), then the epilogue's
    launcher with the values the front's checks read."""
    from musekern.gemm import fp8 as gemm_fp8
    from musekern.reference import quantize_x_per_token

    rec = recorder
    quantized = []  # the channel path quantizes x with the x_quant kernel (ops/x_quant.py; its reference here); the
    # block path on a CPU tensor takes the bf16 copy's GEMM (torch serves block scaling on CUDA only), no quantization
    monkeypatch.setattr(op.x_quant, "quantize", lambda x, group=0, rows=None: quantized.append((x.shape, group))
                        or quantize_x_per_token(x))
    monkeypatch.setitem(op._RUNS_W8, ("bf16", mode), op.Plans(lambda *k: op._GEMM))
    monkeypatch.setattr(op.qkv_epilogue, "_RUNS", op.Plans(lambda *k: rec))
    c = w8_case(mode, m=40, num_blocks=16)
    y = op.qkv_front(**c)
    assert quantized == ([((40, 8192), 0)] if mode == "channel" else [])
    want_y = gemm_fp8.mm(c["x"], c["weight"], c["weight_scale"], torch.empty_like(y))
    assert torch.equal(y, want_y)
    want = op.qkv_epilogue.launch_args(y, c["positions"], c["cos_sin_cache"], c["slot_mapping"], c["key_cache"],
                                       c["value_cache"], 1, EPS)
    assert len(rec.calls) == 1 and dict(zip(op.qkv_epilogue._NAMES, rec.calls[0], strict=True)) == want


def test_fp8_weight_unchecked_gemm_epilogue_takes_gemm_fp8(monkeypatch):
    calls = []
    monkeypatch.setattr(op.gemm_fp8, "mm", lambda x, w, s, out, quantize: calls.append((w.dtype, s.shape))
                        or out.zero_())
    monkeypatch.setattr(op.gemm, "mm", lambda *a: pytest.fail("the bf16 GEMM"))
    monkeypatch.setattr(op.qkv_epilogue, "launch", lambda y, *a, **k: y)
    c = w8_case("block", m=20, num_blocks=16)
    op.launch_gemm_epilogue(**c, out=torch.empty(20, 2176, dtype=torch.bfloat16))
    assert calls == [(torch.float8_e4m3fn, (34, 64))]


# every N the bundled model plans (TP8..TP1): e4m3 weights take the fused front (the mma.sync builds) at M <= 16, and
# up to 32 at TP8 (rules.W8_WIDE_TILES), whatever the bf16 weight's rule; each side of 16 and 32, the bf16 rule's edges
@pytest.mark.parametrize("n", [2176, 4352, 8704, 17408])
def test_fp8_weight_path_follows_the_planner(monkeypatch, n):
    monkeypatch.setattr(op, "_target", lambda dev: get_target("h200"))
    op._fused.cache_clear()
    ms = (1, 8, 9, 16, 17, 32, 33, 48, 64, 65, 4096)
    try:
        assert [m for m in ms if op._fused(n, m, 0, "fp8_e4m3")] == [m for m in ms if m <= (32 if n == 2176 else 16)]
    finally:
        op._fused.cache_clear()


@pytest.mark.parametrize("mode", ["channel", "block"])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_op_binds_every_planned_fp8_weight_abi_by_name(mode, kv):
    """The e4m3-weight builds the rules give M = 1..64 (TP8: 1, 2 and 4 tiles): the op binds each ABI by its names,
    the scale's address where bf16 builds take weight_ptr."""
    from musekern.kernels.qkv_front.abi import abi_for
    from musekern.kernels.qkv_front.rules import qkv_front_variants
    from musekern.ops._bind import take
    from musekern.runtime.loader import _ParamBlock

    c = w8_case(mode, case=make_case if kv == "bf16" else fp8_case)
    out = torch.empty(5, 2176, dtype=torch.bfloat16)
    call = (c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"], c["key_cache"],
            c["value_cache"], EPS, out, None, 0.25, c["weight_scale"])
    names_op = op._NAMES_W8 if kv == "bf16" else op._NAMES_W8_FP8
    values = (op._w8_values if kv == "bf16" else op._w8_fp8_values)(*call)
    by_name = op.launch_args(*call)
    vs = qkv_front_variants(2176, 1, get_target("h200"), 64, kv, "fp8_e4m3", mode)
    assert max(v.tiles for v in vs) == 4 and all(v.weight_dtype == "fp8_e4m3" and v.weight_scale == mode for v in vs)
    for v in vs:
        abi = abi_for(v)
        names = tuple(_ParamBlock(abi.params, abi.tensormaps).names)
        assert "weight_scale" in names and "weight_ptr" not in names
        # x quantized ahead (TP8's W8A8): the launcher appends x_quant's scales' address (ops._x_ahead)
        ahead = ("x_scale",) if v.x_dtype != "bf16" else ()
        picked = [(list(values) + [None] * len(ahead))[i] for i in take(v.label, names, names_op + ahead)]
        assert all(n == "x_scale" or val is by_name[n] or val == by_name[n]
                   for n, val in zip(names, picked, strict=True))
        assert picked[names.index("weight_scale")] == c["weight_scale"].data_ptr()


def test_bf16_weight_takes_the_bf16_plan_and_values(as_if_cuda, recorder, monkeypatch):
    """A bf16 call (weight_scale None) keeps the bf16 build's plan table and values (weight_ptr = the weight)."""
    rec = recorder
    monkeypatch.setattr(op, "_RUNS", op.Plans(lambda *k: rec))
    monkeypatch.setattr(op, "_RUNS_W8", {k: op.Plans(lambda *a: pytest.fail("an e4m3 plan")) for k in op._RUNS_W8})
    c = make_case()
    op.qkv_front(**c, weight_scale=None)
    assert rec.calls[0][op._NAMES.index("weight_ptr")] == c["weight"].data_ptr()


def test_fp8_weight_auto_on_cpu_is_the_reference():
    for mode in ("channel", "block"):
        c, c2 = w8_case(mode), w8_case(mode)
        assert torch.equal(op.qkv_front_auto(**c), qkv_front_reference(**c2))
        assert torch.equal(c["key_cache"], c2["key_cache"])


@pytest.mark.parametrize("value,scale", [("bf16", "none"), ("fp8-block", "block"), ("fp8-block-ue8m0", "block"),
                                         ("fp8-channel", "channel"), ("fp8-tensor", "channel")])
def test_prepare_weight_format_spellings(value, scale):
    from musekern.ops.checks import weight_format

    assert weight_format(value).kernel_scale == scale
    assert weight_format(weight_format(value)) == weight_format(value)


@pytest.mark.parametrize("value", ["auto", "fp8", "int8", None])
def test_prepare_weight_format_rejects_others(value):
    from musekern.ops.checks import weight_format

    with pytest.raises(ValueError, match=r"^weight_format must be one of bf16, fp8-block, .* or a WeightFormat, got"):
        weight_format(value)


# prepare of a block-FP8 weight says, before any capture, which M take torch's 1x128 call (faulted in graph replay);
# the fused front's M (<= 16 at TP4) and a channel weight (row-wise _scaled_mm) do not
@pytest.mark.parametrize("fmt,warned", [("fp8-block", "17,48"), ("fp8-channel", None)])
def test_prepare_names_the_m_of_torchs_block_call(monkeypatch, caplog, fmt, warned):
    from musekern.gemm import fp8 as gemm_fp8

    monkeypatch.setattr(op.checks, "prepare_args", lambda N, rows, nkv, device: (0, 2, sorted(rows)))
    monkeypatch.setattr(op, "_fused", lambda N, m, dev, dtype: m <= 16)
    monkeypatch.setattr(op, "_front_plan", lambda *a: ("front",))
    monkeypatch.setattr(op.qkv_epilogue, "prepare", lambda *a: ["epilogue"])
    monkeypatch.setattr(op.x_quant, "prepare", lambda dev, group=0: f"x_quant{group}")
    monkeypatch.setattr(gemm_fp8, "block_scaled_mm", lambda device: object())
    with caplog.at_level("WARNING", logger="musekern.gemm"):
        op.prepare(4352, rows=[1, 16, 17, 48], weight_format=fmt)
    notes = [r.getMessage() for r in caplog.records if "faulted in CUDA-graph replay" in r.getMessage()]
    if warned is None:
        assert notes == []
    else:
        assert len(notes) == 1 and f"N = 4352, M = {warned}:" in notes[0] and "keep these M out" in notes[0]
