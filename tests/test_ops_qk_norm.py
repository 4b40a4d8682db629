"""musekern.qk_norm: the checks before launch (CPU) and the kernel against an fp32 reference (GPU)."""
import sys

import pytest
import torch

import musekern
from musekern.ops.qk_norm import qk_norm_unsupported
from musekern.reference import qk_norm_reference


# ---------------------------------------------------------------- rejected calls (CPU: checks run before any launch)
def _x(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("make,exc,msg", [
    (lambda: (_x(4, 128, dtype=torch.float32), 64), TypeError, "bfloat16 or float16"),
    (lambda: ([[1.0]], 64), TypeError, "torch.Tensor"),
    (lambda: (_x(2, 4, 64), 64), ValueError, "2-D"),
    (lambda: (_x(4, 100), 64), ValueError, "multiple of head_dim"),
    (lambda: (_x(4, 96), 96), ValueError, "head_dim must be one of"),
    (lambda: (_x(128, 4).t(), 64), ValueError, "last dim must be contiguous"),
    (lambda: (_x(4, 130)[:, :128], 64), ValueError, "row stride"),
    (lambda: (_x(4, 128), 64), ValueError, "CUDA device"),
])
def test_rejected_before_launch(make, exc, msg):
    x, hd = make()
    with pytest.raises(exc, match=msg):
        musekern.qk_norm(x, hd)


def test_bad_out_rejected():
    x = _x(4, 128)
    assert "out must be" in qk_norm_unsupported(x, 64, out=torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must be"):
        musekern.qk_norm(x, 64, out=torch.empty(4, 128, dtype=torch.float16))


# every rejection above (but the CPU device: these tensors claim CUDA), and the calls the checks take to the slow path:
# M = 0, an int eps or scale, out of another shape / dtype / layout / alignment, a misaligned x
_OUT_BASE = torch.empty(4 * 128 + 8, dtype=torch.bfloat16)
FAST_REJECT = [(x, hd, {}) for x, hd in ((_x(4, 128, dtype=torch.float32), 64), ([[1.0]], 64), (_x(2, 4, 64), 64),
                                         (_x(4, 100), 64), (_x(4, 96), 96), (_x(128, 4).t(), 64),
                                         (_x(4, 130)[:, :128], 64), (_x(0, 128), 64),
                                         (torch.empty(4 * 128 + 8, dtype=torch.bfloat16)[4:4 + 512].view(4, 128), 64))
                ] + [
    (_x(4, 128), 64, {"eps": 0}), (_x(4, 128), 64, {"scale": 1}),
    (_x(4, 128), 64, {"out": torch.empty(4, 64, dtype=torch.bfloat16)}),
    (_x(4, 128), 64, {"out": torch.empty(4, 128, dtype=torch.float16)}),
    (_x(4, 128), 64, {"out": torch.empty(128, 4, dtype=torch.bfloat16).t()}),
    (_x(4, 128), 64, {"out": torch.empty(4, 132, dtype=torch.bfloat16)[:, :128]}),
    (_x(4, 128), 64, {"out": _OUT_BASE[4:4 + 512].view(4, 128)})]


@pytest.mark.parametrize("case", range(len(FAST_REJECT)))
def test_fast_path_never_accepts_a_rejected_call(as_if_cuda, recorder, monkeypatch, case):
    from musekern.ops import qk_norm as op

    monkeypatch.setattr(op, "_PLANS", op.Plans(lambda *key: recorder))
    x, hd, kw = FAST_REJECT[case]
    assert op._fast(x, hd, kw.get("eps", 1e-5), kw.get("scale", 1.0), kw.get("out")) is None
    assert recorder.calls == []


def test_fast_path_leaves_more_vectors_than_an_int32_to_launch_grid(as_if_cuda, recorder, monkeypatch):
    from musekern.ops import qk_norm as op

    monkeypatch.setattr(op, "_PLANS", op.Plans(lambda *key: recorder))
    monkeypatch.setattr(op, "_MAX_ELEMS", 4 * 128 - 1)  # (the real bound needs 2^34 elements)
    assert op._fast(_x(4, 128), 64, 1e-5, 1.0, None) is None and recorder.calls == []
    monkeypatch.setattr(op, "_MAX_ELEMS", 4 * 128)
    assert op._fast(_x(4, 128), 64, 1e-5, 1.0, None) is not None and len(recorder.calls) == 1


# contiguous and strided rows (q heads inside a fused row), M = 1 and 16, out given or allocated, scale on / off
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("give_out,scale", [(False, 1.0), (True, 0.5)])
def test_the_checked_call_launches_the_values_it_checked(as_if_cuda, recorder, monkeypatch, strided, m, give_out,
                                                          scale):
    from musekern.ops import qk_norm as op

    keys = []
    monkeypatch.setattr(op, "_PLANS", op.Plans(lambda *key: keys.append(key) or recorder))
    x = _x(m, 2176)[:, :1024] if strided else _x(m, 1024)
    out = torch.empty(m, 1024, dtype=torch.bfloat16) if give_out else None
    y = musekern.qk_norm(x, 64, 1e-6, scale, out=out)
    assert (y is out) if give_out else (y.shape == (m, 1024) and y.dtype == torch.bfloat16)
    assert recorder.calls == [op._all_values(x, y, m, 16, 1e-6, scale)]
    assert keys == [("bfloat16", 64, scale, m, 16, 0)]


def test_reference_math():
    # The reference computes in fp32 whatever the input dtype (the kernels' math), so against the fp64 formula it
    # agrees to fp32 precision: a few 2^-24 relative. float64's default tolerance (1e-7) is tighter than that and
    # failed about one draw in ten on an unseeded input; seeded now, with the tolerance the fp32 math has.
    x = torch.randn(3, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ref = qk_norm_reference(x, 128, eps=1e-6, scale=0.5)
    g = x.reshape(3, 2, 128)
    want = g / torch.sqrt((g * g).mean(-1, keepdim=True) + 1e-6) * 0.5
    torch.testing.assert_close(ref, want.reshape(3, 256), rtol=1e-6, atol=0)
    # and over many draws, the error stays within that bound
    for seed in range(200):
        x = torch.randn(3, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        g = x.reshape(3, 2, 128)
        want = (g / torch.sqrt((g * g).mean(-1, keepdim=True) + 1e-6) * 0.5).reshape(3, 256)
        torch.testing.assert_close(qk_norm_reference(x, 128, eps=1e-6, scale=0.5), want, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- the kernel on the GPU
# M: 1 and 7 (tails smaller than a tile), 16 (decode), 333 (odd, several CTAs), 4096 (prefill-sized): M <= 16
# takes the one-vector-per-thread build, 333 and 4096 the four-vector one; head_dim: every supported one;
# scale on/off picks the with/without-scale builds; strided rows as in a fused qkv.
GRID = [(m, hd, scale, strided) for m in (1, 7, 16, 333, 4096) for hd in (64, 128, 256)
        for scale in (1.0, 0.5) for strided in (False, True)]


def _ulp_tol(dtype):
    return {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("m,hd,scale,strided", GRID)
def test_qk_norm_matches_fp32_reference(gpu_cache_dir, record_property, m, hd, scale, strided):
    torch.manual_seed(m * 1000 + hd + int(strided))
    heads = 2048 // hd
    width = heads * hd
    ld = width + (3 * 64 if strided else 0)  # strided rows: q heads inside a wider fused row
    base = torch.randn(m, ld, device="cuda", dtype=torch.float32) * 3 + 0.5
    x = base.to(torch.bfloat16)[:, :width]
    assert x.stride(0) == ld
    out = torch.full((m, width), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
    y = musekern.qk_norm(x, hd, eps=1e-5, scale=scale, out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    assert not torch.isnan(y).any(), "some outputs were not written"
    ref = qk_norm_reference(x.double(), hd, eps=1e-5, scale=scale)  # fp64 reference of the same bf16 inputs
    err = (y.double() - ref).abs()
    tol = _ulp_tol(torch.bfloat16) * ref.abs() + 1e-6  # one bf16 ulp: fp32 math, one rounding
    record_property("max_abs_err", err.max().item())
    record_property("max_err_over_ulp", (err / tol).max().item())
    assert (err <= tol).all(), f"max err {err.max().item():.3e}"
    assert "cutlass" not in sys.modules


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_qk_norm_fp16(gpu_cache_dir, hd):
    x = (torch.randn(33, 4 * hd, device="cuda") * 2).half()
    y = musekern.qk_norm(x, hd, eps=1e-6)
    ref = qk_norm_reference(x.double(), hd, eps=1e-6)
    assert ((y.double() - ref).abs() <= _ulp_tol(torch.float16) * ref.abs() + 1e-6).all()


@pytest.mark.gpu
def test_qk_norm_deterministic_and_graph_replay(gpu_cache_dir):
    x = torch.randn(16, 2048, device="cuda").to(torch.bfloat16)
    outs = [musekern.qk_norm(x, 64, scale=0.5).clone() for _ in range(5)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    static_out = torch.empty_like(outs[0])
    musekern.qk_norm(x, 64, scale=0.5, out=static_out)  # loads the kernel before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        musekern.qk_norm(x, 64, scale=0.5, out=static_out)
    static_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("m,hd", [(16, 64), (333, 128), (5, 256)])
def test_vecs_per_thread_does_not_change_a_bit(gpu_cache_dir, m, hd):
    """The one- and four-vector builds walk the same vectors with the same math: identical outputs."""
    from musekern.kernels.qk_norm.variant import QkNormVariant, launch_grid
    from musekern.runtime import get_kernel

    heads = 2048 // hd
    x = (torch.randn(m, heads * hd + 64, device="cuda") * 3).to(torch.bfloat16)[:, :heads * hd]
    outs = []
    for vpt in (1, 4):
        v = QkNormVariant("bfloat16", hd, True, vpt)
        out = torch.full((m, heads * hd), float("nan"), device="cuda", dtype=torch.bfloat16)
        get_kernel(v).launch(launch_grid(v, m, heads), {"x": x.data_ptr(), "out": out.data_ptr(), "m": m,
                                                        "heads": heads, "ld_x": x.stride(0), "ld_out": out.stride(0),
                                                        "eps": 1e-5, "scale": 0.5})
        outs.append(out)
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_qk_norm_runs_from_the_carried_cache(gpu_cache_dir):
    """The cubin that ran is an entry of the cache built on the CPU machine (no compiler here)."""
    from musekern.runtime import loaded_kernels

    musekern.qk_norm(torch.randn(2, 128, device="cuda").to(torch.bfloat16), 64)
    ks = [k for k in loaded_kernels() if k.entry.manifest["kernel"] == "qk_norm"]
    assert ks and all(str(k.entry.path).startswith(str(gpu_cache_dir)) for k in ks)
    assert all(k.entry.manifest["arch"] == "sm_90a" for k in ks)
    assert "cutlass" not in sys.modules
