"""qkv_epilogue op on CPU: every rejection of `unsupported` (one line naming the argument and what is wrong), the
error types of the checked call, and the launch values it binds by ABI name (no GPU: CPU tensors)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from musekern.kernels.qkv_epilogue.variant import EPI_HUGE, QkvEpilogueVariant, max_rows  # noqa: E402
from musekern.ops import qkv_epilogue as op  # noqa: E402
from musekern.ops.checks import SCALE_VALUES  # noqa: E402
from musekern.reference import rope_cos_sin_table  # noqa: E402

D = 64


def case(m=5, nkv=1, layout="vllm", num_blocks=6, block_size=4, max_pos=64):
    """A valid call (on CPU: only the device check rejects it). N = (2 * 16 nkv + 2 nkv) * 64."""
    n = (2 * 16 * nkv + 2 * nkv) * D
    shape = (num_blocks, block_size, nkv, D)
    if layout == "vllm":
        kv = torch.zeros(2, *shape, dtype=torch.bfloat16)
        kc, vc = kv[0], kv[1]
    else:
        kv = torch.zeros(num_blocks, 2, *shape[1:], dtype=torch.bfloat16)
        kc, vc = kv[:, 0], kv[:, 1]
    return dict(y=torch.zeros(m, n, dtype=torch.bfloat16), positions=torch.arange(m), cos_sin_cache=rope_cos_sin_table(
        max_pos, 10000.0), slot_mapping=torch.arange(m), key_cache=kc, value_cache=vc, num_kv_heads=nkv, eps=1e-5)


def reason(**over):
    c = case()
    c.update(over)
    return op.unsupported(**c)


def test_valid_cpu_call_is_refused_only_for_its_device():
    for layout in ("vllm", "flashinfer"):
        for m in (0, 1, 17):
            r = op.unsupported(**case(m=m, layout=layout))
            assert r == "y must be on a CUDA device, got cpu (use musekern.reference for CPU tensors)"


def _aligned_plus(shape, dtype, elems):
    """A tensor of `shape` whose data starts `elems` elements past a 16-byte boundary."""
    base = torch.zeros(int(torch.Size(shape).numel()) + 16, dtype=dtype)
    return base[elems:elems + torch.Size(shape).numel()].view(shape)


_Y = case()["y"]
# (override, words the one-line reason must contain)
REJECTIONS = [
    (dict(y=[[1.0]]), "y must be a torch.Tensor, got list"),
    (dict(positions=None), "positions must be a torch.Tensor"),
    (dict(y=_Y.float()), "y.dtype must be bfloat16, got torch.float32"),
    (dict(y=_Y[0]), "y must be 2-D [M, N]"),
    (dict(y=torch.zeros(5, 2176 + 64, dtype=torch.bfloat16)), "N=2240 (y.shape[1]) is not a q|k|v|gate layout"),
    (dict(num_kv_heads=2), "with num_kv_heads=2"),
    (dict(num_kv_heads=1.0), "num_kv_heads must be an int, got 1.0"),
    (dict(num_kv_heads=True), "num_kv_heads must be an int"),
    (dict(y=torch.zeros(2176, 5, dtype=torch.bfloat16).t()), "y's last dim must be contiguous"),
    (dict(y=torch.zeros(5, 2180, dtype=torch.bfloat16)[:, :2176]), "row stride (2180) must be a multiple of 8"),
    (dict(y=_aligned_plus((5, 2176), torch.bfloat16, 4)), "y must be 16-byte aligned (data_ptr % 16 = 8)"),
    (dict(positions=torch.arange(5, dtype=torch.int32)), "positions.dtype must be int64, got torch.int32"),
    (dict(slot_mapping=torch.arange(6)), "slot_mapping must be [M=5], got shape (6,)"),
    (dict(slot_mapping=torch.arange(10)[::2]), "slot_mapping must be contiguous, got stride 2"),
    (dict(cos_sin_cache=rope_cos_sin_table(64, 1e4).double()), "cos_sin_cache.dtype must be float32"),
    (dict(cos_sin_cache=torch.zeros(64, 32)), "cos_sin_cache must be [max_pos >= 1, 64], got shape (64, 32)"),
    (dict(cos_sin_cache=torch.zeros(0, 64)), "cos_sin_cache must be [max_pos >= 1, 64]"),
    (dict(cos_sin_cache=torch.zeros(64, 128)[:, :64]), "cos_sin_cache must be contiguous"),
    (dict(cos_sin_cache=_aligned_plus((64, 64), torch.float32, 1)), "cos_sin_cache must be 16-byte aligned"),
    (dict(key_cache=torch.zeros(6, 4, 1, D)), "key_cache.dtype must be bfloat16"),
    (dict(value_cache=torch.zeros(6, 4, 2, D, dtype=torch.bfloat16)), "value_cache must be [num_blocks, block_size, "
                                                                       "num_kv_heads=1, 64]"),
    (dict(key_cache=torch.zeros(6, D, 4, 1, dtype=torch.bfloat16).permute(0, 2, 3, 1)),
     "key_cache's inner three dims must be contiguous"),
    (dict(value_cache=torch.zeros(7, 4, 1, D, dtype=torch.bfloat16)), "differ in shape"),
    (dict(key_cache=torch.zeros(6 * 4 * D + 8, dtype=torch.bfloat16)[4:4 + 6 * 4 * D].view(6, 4, 1, D)),
     "key_cache must be 16-byte aligned (data_ptr % 16 = 8)"),
    (dict(key_cache=torch.zeros(6, 4 * D + 4, dtype=torch.bfloat16)[:, :4 * D].view(6, 4, 1, D)),
     "key_cache's block stride (260 elements) must be a multiple of 8"),
    (dict(eps=-1e-5), "eps must be a finite float >= 0, got -1e-05"),
    (dict(eps=float("inf")), "eps must be a finite float"),
    (dict(eps=float("nan")), "eps must be a finite float"),
    (dict(eps="1e-5"), "eps must be a finite float"),
]


@pytest.mark.parametrize("over,words", REJECTIONS, ids=[w[:40] for _, w in REJECTIONS])
def test_rejections(over, words):
    r = reason(**over)
    assert r is not None and words in r, r
    assert "\n" not in r and len(r) < 240


def test_y_overlapping_a_cache_is_refused():
    kv = torch.zeros(2, 20, 4, 1, D, dtype=torch.bfloat16)
    y = kv.view(-1)[:2 * 2176].view(2, 2176)  # y inside the key cache
    c = case(m=2)
    r = op.unsupported(**dict(c, y=y, key_cache=kv[0], value_cache=kv[1]))
    assert r == "y overlaps key_cache (y is rewritten in place while the caches are written)"


def test_too_many_rows_is_refused_with_the_limit():
    top = max_rows(QkvEpilogueVariant(*EPI_HUGE), 2176, 1)
    y = torch.empty(1, 2176, dtype=torch.bfloat16).expand(top + 1, 2176)  # one row of memory: only shapes are read
    r = reason(y=y, positions=torch.empty(1, dtype=torch.int64).expand(top + 1),
               slot_mapping=torch.empty(1, dtype=torch.int64).expand(top + 1))
    assert r == f"M={top + 1} rows of N=2176 exceed one launch's {top} (Int32 unit index); split the call"


@pytest.mark.parametrize("over,exc", [(dict(y=_Y.float()), TypeError), (dict(num_kv_heads="1"), TypeError),
                                      (dict(positions=None), TypeError), (dict(eps=-1.0), ValueError),
                                      (dict(num_kv_heads=3), ValueError), ({}, ValueError)])
def test_checked_call_raises_with_the_reason(over, exc):
    c = case()
    c.update(over)
    with pytest.raises(exc, match="^qkv_epilogue: "):
        op.qkv_epilogue(**c)


@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_launch_args_bind_every_abi_name(layout):
    c = case(m=3, nkv=2, layout=layout)
    c["y"] = torch.zeros(3, 4352 + 64, dtype=torch.bfloat16)[:, :4352]  # strided rows (a view of a wider y)
    args = op.launch_args(**c)
    kc = c["key_cache"]
    assert args == {"y": c["y"].data_ptr(), "positions": c["positions"].data_ptr(),
                    "cos_sin_cache": c["cos_sin_cache"].data_ptr(), "slot_mapping": c["slot_mapping"].data_ptr(),
                    "key_cache": kc.data_ptr(), "value_cache": c["value_cache"].data_ptr(), "M": 3,
                    "num_q_heads": 32, "num_kv_heads": 2, "ld_y": 4416, "max_pos": 64, "block_size": 4,
                    "num_blocks": 6, "k_block_stride": kc.stride(0), "v_block_stride": c["value_cache"].stride(0),
                    "eps": 1e-5}
    assert kc.stride(0) == (2 if layout == "flashinfer" else 1) * 4 * 2 * D
    ks = torch.tensor(0.5)
    args8 = op.launch_args(**{**c, "key_cache": kc.view(torch.uint8)[..., :D], "value_cache": c["value_cache"].view(
        torch.uint8)[..., :D]}, k_scale=ks, v_scale=2.0)  # FP8 caches: the scales' four values too
    assert {k: args8[k] for k in SCALE_VALUES} == {"k_scale_ptr": ks.data_ptr(), "k_scale": 1.0, "v_scale_ptr": 0,
                                                   "v_scale": 2.0}
    pytest.importorskip("cutlass")
    from musekern.kernels.qkv_epilogue.abi import abi_for

    fields = lambda v: {f.name for p in abi_for(v).params for f in p.fields}  # noqa: E731
    assert set(args) == fields(QkvEpilogueVariant(1))
    assert set(args8) == fields(QkvEpilogueVariant(1, kv_cache_dtype="fp8_e4m3"))


# every rejection above, plus inputs the reasons turn down only after a cheap look (wrong ranks, an int eps)
FAST_REJECT = [over for over, _ in REJECTIONS] + [
    dict(y=torch.zeros(5, 2176, 1, dtype=torch.bfloat16)), dict(cos_sin_cache=torch.zeros(64 * 64)),
    dict(positions=torch.arange(5)[None]), dict(eps=0), dict(y=torch.zeros(0, 2176, dtype=torch.bfloat16))]


@pytest.mark.parametrize("over", FAST_REJECT)
def test_fast_path_never_accepts_a_rejected_call(as_if_cuda, over):
    """The fast path (checks reading each attribute once, the host cost) is stricter than the reasons."""
    c = case()
    c.update(over)
    assert op._fast(**c, dry=True) is None


# both layouts, one and two KV heads, M = 1 (the row stride of a one-row y is N) and M = 17
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("nkv,m", [(1, 1), (2, 17)])
def test_the_checked_call_launches_the_values_it_checked(as_if_cuda, recorder, monkeypatch, layout, nkv, m):
    rec = recorder
    monkeypatch.setattr(op, "_RUNS", op.Plans(lambda n, m, nkv, dev: rec))
    c = case(m=m, nkv=nkv, layout=layout, num_blocks=8)
    assert op.qkv_epilogue(**c) is c["y"]
    assert len(rec.calls) == 1 and dict(zip(op._NAMES, rec.calls[0], strict=True)) == op.launch_args(**c)
    n = c["y"].shape[1]
    assert list(op._RUNS) == [(n, m, nkv, 0)]


def test_zero_rows_launch_nothing():
    c = case(m=0)
    assert op.launch(**c) is c["y"]  # returns before any kernel lookup (there is no GPU here)
