"""musekern/weights/pack.py: one rank's canonical FP8 front weight from each checkpoint format, checked against an
independent fp64 dequantization of the checkpoint (exact in fp32: an e4m3 value times an fp32 scale needs at most
28 significant bits, so the fp64 product is exact and its fp32 rounding is the fp32 product)."""
import functools
from dataclasses import replace

import pytest
import torch

from musekern.config import ShardShape
from musekern.weights.formats import parse_override
from musekern.weights.pack import PackedWeight, dequantize, pack_rank, quantize_reference, rank_rows, to_e4m3

K = 8192
BLOCK, UE8M0, CHANNEL, TENSOR = (parse_override(v) for v in ("fp8-block", "fp8-block-ue8m0", "fp8-channel",
                                                            "fp8-tensor"))
# compressed-tensors (and Qwen3-FP8's weight_scale_inv) store scales in the model's dtype, bf16
BF16_SCALES = {g: replace(parse_override(f"fp8-{g}"), scale_dtype="bfloat16") for g in ("block", "channel")}
FORMATS = {"block": BLOCK, "block-ue8m0": UE8M0, "block-bf16": BF16_SCALES["block"], "channel": CHANNEL,
           "channel-bf16": BF16_SCALES["channel"], "tensor": TENSOR}


def heads(nq, nkv, tp, r):
    """Which q and kv heads rank r of tp holds (written independently of pack.rank_rows: kv heads replicate)."""
    q = range(r * nq // tp, (r + 1) * nq // tp)
    kv = range(r * nkv // tp, (r + 1) * nkv // tp) if tp <= nkv else range(r * nkv // tp, r * nkv // tp + 1)
    return q, kv


def fp64_rows(fmt, w, s, hs):
    """fp64 dequantization of heads `hs` (64 rows each) of one checkpoint tensor, from its stored layout."""
    rows = torch.cat([torch.arange(h * 64, h * 64 + 64) for h in hs])
    x = w.view(torch.uint8)[rows].view(torch.float8_e4m3fn).double()
    sd = s.double()
    if fmt.granularity == "block":  # the scale of element (i, j) is s[i // 128, j // 128]
        return (x.reshape(len(rows), K // 128, 128) * sd[rows // 128][:, :, None]).reshape(len(rows), K)
    if fmt.granularity == "channel":
        return x * sd.reshape(-1)[rows][:, None]
    return x * sd.reshape(())


def expected(fmt, ckpt, nq, nkv, tp, r, heads_at_once=4):
    """The rank's q | k | v | gate rows, dequantized in fp64 and rounded to fp32, `heads_at_once` heads at a time
    (16 MiB of fp64: the bundled model's TP 1 is 1.1 GiB at once)."""
    qh, kvh = heads(nq, nkv, tp, r)
    for p, hs in (("q", qh), ("k", kvh), ("v", kvh), ("gate", qh)):
        for i in range(0, len(hs), heads_at_once):
            yield fp64_rows(fmt, *ckpt[p], hs[i:i + heads_at_once]).float()


def check(fmt, ckpt, nq, nkv, tp, r):
    packed = pack_rank(fmt, ckpt, num_q_heads=nq, num_kv_heads=nkv, tp=tp, rank=r, gate=True)
    n = ShardShape(tp, nq // tp, max(1, nkv // tp), 64, True).n  # the rank's N as the planner sees it
    assert packed.n == n and packed.fmt == fmt and packed.weight.dtype == torch.float8_e4m3fn
    assert list(packed.weight.shape) == [n, K] and packed.weight.is_contiguous()
    assert packed.weight_scale.dtype == torch.float32 and packed.weight_scale.is_contiguous()
    assert list(packed.weight_scale.shape) == ([n // 64, K // 128] if fmt.granularity == "block" else [n])
    got, at = dequantize(packed), 0
    for want in expected(fmt, ckpt, nq, nkv, tp, r):
        assert torch.equal(got[at:at + want.shape[0]], want), (at, want.shape[0])
        at += want.shape[0]
    assert at == n
    return packed


@functools.lru_cache(maxsize=None)
def _synthetic(name, nq, nkv, seed):  # by name: formats differing only in scale_dtype compare equal
    return synthetic(FORMATS[name], nq, nkv, seed)


def synthetic(fmt, nq, nkv, seed=0):
    """A small checkpoint made by quantize_reference from fp32 weights whose magnitude varies by row and by K block
    (so every block, row and tensor has its own scale)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (part, rows) in enumerate((("q", nq * 64), ("k", nkv * 64), ("v", nkv * 64), ("gate", nq * 64))):
        mag = torch.exp(torch.randn(rows, 1, generator=g)) * torch.exp(torch.randn(1, K // 128, generator=g)
                                                                        ).repeat_interleave(128, 1)
        w = torch.randn(rows, K, generator=g) * mag * 10.0 ** (i - 2)
        out[part] = quantize_reference(w, fmt)
    return out


# A small model whose kv heads replicate past TP 2 (8 q heads, 2 kv heads: TP 2 gives each rank one 64-row kv head,
# half a 128-row block; TP 4 and 8 share each kv head between ranks), every format musekern reads (block fp32 /
# ue8m0 / bf16 scales, per-channel fp32 / bf16, per-tensor), every TP size the bundled config plans, every rank.
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", FORMATS)
def test_small_model_every_rank(name, tp):
    fmt = FORMATS[name]
    ckpt = _synthetic(name, 8, 2, 0)
    for r in range(tp):
        check(fmt, ckpt, 8, 2, tp, r)


def test_per_tensor_scales_stored_as_0dim_are_read():  # AutoFP8's weight_scale: a 0-dim tensor; compressed: (1,)
    ckpt = {p: (w, s.reshape(())) for p, (w, s) in _small("tensor").items()}
    packed = check(TENSOR, ckpt, 8, 2, 2, 1)
    # per-tensor scales become per-row scales of the fused projection, each part keeping its own (no requant)
    assert packed.weight_scale.unique().numel() == 4


def test_uint8_weights_are_read_as_e4m3():  # vLLM and some loaders keep fp8 as bytes
    ckpt = {p: (w.view(torch.uint8), s) for p, (w, s) in _small().items()}
    check(BLOCK, ckpt, 8, 2, 4, 3)


@pytest.fixture(scope="module")
def bundled():
    """The bundled model's full, unsharded q | k | v | gate bytes (128 q heads, 8 kv heads): random e4m3 (no NaN)."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for p, rows in (("q", 8192), ("k", 512), ("v", 512), ("gate", 8192)):
        b = torch.randint(0, 256, (rows, K), dtype=torch.uint8, generator=g)
        out[p] = torch.where((b & 0x7F) == 0x7F, b ^ 1, b).view(torch.float8_e4m3fn)
    return out


def scales(fmt, rows, seed):
    """Random checkpoint scales of `fmt`'s stored shape and dtype (powers of two for ue8m0)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"block": (-(-rows // 128), K // 128), "channel": (rows, 1), "tensor": (1,)}[fmt.granularity]
    if fmt.ue8m0:
        return torch.ldexp(torch.ones(shape), torch.randint(-14, -4, shape, generator=g))
    return (torch.rand(shape, generator=g) * 1e-2 + 1e-4).to(getattr(torch, fmt.scale_dtype))


# The bundled model (128 q heads, 8 kv heads): every format at TP 8, where each rank's k and v are one 64-row head
# (half a checkpoint block: the case vLLM refuses), all ranks for the block formats; block and per-channel at
# TP 1, 2, 4 on one rank each (the full-size dequantization costs seconds: TP 1 alone is 17408 x 8192).
@pytest.mark.parametrize("name,tp,ranks", [
    ("block", 8, range(8)), ("block-ue8m0", 8, range(8)), ("block-bf16", 8, (0, 1, 7)), ("channel", 8, (0, 5)),
    ("tensor", 8, (3,)), ("channel-bf16", 8, (6,)),
    ("block", 1, (0,)), ("block", 2, (1,)), ("block", 4, (2,)), ("channel", 2, (0,)), ("tensor", 4, (3,)),
])
def test_bundled_model(bundled, name, tp, ranks):
    fmt = FORMATS[name]
    ckpt = {p: (w, scales(fmt, w.shape[0], i)) for i, (p, w) in enumerate(bundled.items())}
    for r in ranks:
        check(fmt, ckpt, 128, 8, tp, r)


def test_tp8_kv_halves_take_their_blocks_scale(bundled):
    """TP 8 of 8 KV heads: ranks 2 and 3 hold kv heads 2 and 3, the two 64-row halves of the k and v tensors'
    second 128-row block: both take that block's scales, exactly."""
    ckpt = {p: (w, scales(BLOCK, w.shape[0], i)) for i, (p, w) in enumerate(bundled.items())}
    for r in (2, 3):
        s = pack_rank(BLOCK, ckpt, num_q_heads=128, num_kv_heads=8, tp=8, rank=r, gate=True).weight_scale
        assert torch.equal(s[16], ckpt["k"][1][1]) and torch.equal(s[17], ckpt["v"][1][1])  # after 16 q heads
        assert torch.equal(s[:16], ckpt["q"][1][8 * r:8 * r + 8].repeat_interleave(2, 0))


# rank_rows against the planner's shard shapes for the bundled model and a replicating one
@pytest.mark.parametrize("nq,nkv,tp", [(128, 8, 1), (128, 8, 2), (128, 8, 8), (128, 8, 16), (8, 2, 8), (8, 1, 4)])
def test_rank_rows_match_shard_shapes(nq, nkv, tp):
    for r in range(tp):
        rows = rank_rows(num_q_heads=nq, num_kv_heads=nkv, tp=tp, rank=r)
        assert sum(b - a for a, b in rows.values()) == ShardShape(tp, nq // tp, max(1, nkv // tp), 64, True).n
        qh, kvh = heads(nq, nkv, tp, r)
        assert rows["q"] == rows["gate"] == (qh[0] * 64, (qh[-1] + 1) * 64)
        assert rows["k"] == rows["v"] == (kvh[0] * 64, (kvh[-1] + 1) * 64)


# ---------------------------------------------------------------- rejections: one line each


def _small(name="block"):
    return _synthetic(name, 8, 2, 0)


def _with(ckpt, part, w=None, s=None):
    out = dict(ckpt)
    out[part] = (ckpt[part][0] if w is None else w, ckpt[part][1] if s is None else s)
    return out


def _nan_byte(w):
    b = w.view(torch.uint8).clone()
    b[70, 5] = 0xFF
    return b.view(torch.float8_e4m3fn)


CK = _small()
CK_CH = _small("channel")
CK_T = _small("tensor")
CK_UE = _small("block-ue8m0")
Q_ROWS = 512


@pytest.mark.parametrize("fmt,ckpt,kw,reason", [
    (parse_override("bf16"), CK, {}, "packs fp8 weights"),
    (BLOCK, {p: v for p, v in CK.items() if p != "gate"}, {}, "expected the parts q, k, v, gate"),
    (BLOCK, CK, {"gate": False}, "expected the parts q, k, v"),
    (BLOCK, {**CK, "q": CK["q"][0]}, {}, "(weight, scale) pair"),
    (BLOCK, _with(CK, "q", w=CK["q"][0].float()), {}, "q weight is torch.float32; expected float8_e4m3fn"),
    (BLOCK, _with(CK, "k", w=CK["k"][0].view(torch.float8_e5m2)), {}, "k weight is torch.float8_e5m2"),
    (BLOCK, _with(CK, "q", w=CK["q"][0][:, :4096]), {}, "K is the model's hidden size, 8192"),
    (BLOCK, _with(CK, "q", w=CK["q"][0][:448]), {}, "q weight has 448 rows; expected 512"),
    (BLOCK, _with(CK, "v", w=CK["v"][0].reshape(-1)), {}, "v weight has shape [1048576]"),
    (BLOCK, _with(CK, "q", w=[1]), {}, "q weight must be a torch.Tensor"),
    (BLOCK, _with(CK, "gate", w=_nan_byte(CK["gate"][0])), {}, "gate weight holds e4m3 NaN bytes"),
    (BLOCK, _with(CK, "q", s=CK["q"][1][:, :32]), {}, "q scale has shape [4, 32]; a fp8-block checkpoint stores "
                                                        "[4, 64]"),
    (BLOCK, _with(CK, "k", s=torch.ones(2, 64)), {}, "k scale has shape [2, 64]"),  # 64 rows: one (padded) block
    (BLOCK, _with(CK, "q", s=CK["q"][1].double()), {}, "expected float32, bfloat16 or float16"),
    (BLOCK, _with(CK, "q", s=1.0), {}, "q scale must be a torch.Tensor"),
    (BLOCK, _with(CK, "q", s=CK["q"][1].index_fill(0, torch.tensor([1]), float("nan"))), {}, "NaN or inf"),
    (BLOCK, _with(CK, "v", s=CK["v"][1].index_fill(1, torch.tensor([3]), float("inf"))), {}, "NaN or inf"),
    (BLOCK, _with(CK, "q", s=CK["q"][1].index_fill(0, torch.tensor([0]), 0.0)), {}, "value <= 0"),
    (BLOCK, _with(CK, "gate", s=-CK["gate"][1]), {}, "value <= 0"),
    (UE8M0, _with(CK_UE, "q", s=CK_UE["q"][1] * 1.5), {}, "not a power of two"),
    (CHANNEL, _with(CK_CH, "q", s=CK_CH["q"][1][:256]), {}, "[512, 1] or [512] (one per row)"),
    (CHANNEL, _with(CK_CH, "q", s=CK_CH["q"][1].reshape(1, -1)), {}, "q scale has shape [1, 512]"),
    (TENSOR, _with(CK_T, "k", s=torch.ones(2)), {}, "[] or [1] (one per tensor)"),
    (BLOCK, CK, {"rank": 2, "tp": 2}, "rank must be in [0, 2)"),
    (BLOCK, CK, {"tp": 3}, "tp=3 does not divide num_q_heads (8)"),
    (BLOCK, CK, {"num_q_heads": 8, "num_kv_heads": 4, "tp": 8}, "k weight has 128 rows; expected 256"),
    (BLOCK, CK, {"num_kv_heads": 3, "tp": 2}, "tp=2 does not divide num_kv_heads (3)"),
    (BLOCK, CK, {"num_kv_heads": 3, "tp": 4}, "must be a multiple of it to replicate"),
    (BLOCK, CK, {"tp": 0}, "tp must be an integer >= 1"),
])
def test_refused_in_one_line(fmt, ckpt, kw, reason):
    args = {"num_q_heads": 8, "num_kv_heads": 2, "tp": 2, "rank": 0, "gate": True, **kw}
    with pytest.raises(ValueError) as ei:
        pack_rank(fmt, ckpt, **args)
    assert reason in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


def test_nan_bytes_outside_the_rank_are_not_its_business():
    ckpt = _with(CK, "gate", w=_nan_byte(CK["gate"][0]))  # row 70: rank 0 of 2 holds rows [0, 256)
    pack_rank(BLOCK, ckpt, num_q_heads=8, num_kv_heads=2, tp=4, rank=3, gate=True)


# ---------------------------------------------------------------- quantize_reference


def test_to_e4m3_saturates_and_keeps_nan():
    x = torch.tensor([447.0, 448.0, 455.0, 464.0, 480.0, 500.0, 1e30, float("inf"), -464.0, -1e9, float("nan")])
    y = to_e4m3(x).float()
    assert y[:8].eq(448).all() and y[8:10].eq(-448).all() and y[10].isnan()


# Each granularity and scale encoding on rows that are not a multiple of 128 (one 64-row kv head plus a partial
# block), with an all-zero region: scales are amax / 448 (1.0 where amax is 0), ue8m0 rounded up to a power of two,
# the largest |w| of each scale's region lands on 448 (fp32 scales) and nothing is NaN.
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_reference(name):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(5)
    w = torch.randn(192, K, generator=g) * torch.exp(torch.randn(192, 1, generator=g))
    w[:, :128] = 0  # a zero K block (and a zero column region for channel / tensor amax: none)
    q, s = quantize_reference(w, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == getattr(torch, fmt.scale_dtype)
    qf = q.float()
    assert not qf.isnan().any() and qf.abs().max() <= 448
    want = {"block": [2, 64], "channel": [192, 1], "tensor": [1]}[fmt.granularity]
    assert list(s.shape) == want and (s.float() > 0).all()
    if fmt.granularity == "block":
        padded = torch.zeros(256, K)
        padded[:192] = w
        amax = padded.abs().reshape(2, 128, 64, 128).amax(dim=(1, 3))
        assert s[:, 0].float().eq(1.0).all()  # the zero block
        if fmt.ue8m0:
            assert (torch.frexp(s).mantissa == 0.5).all() and (s >= amax / 448).all() and (s < amax / 224)[:, 1:].all()
        elif fmt.scale_dtype == "float32":
            assert torch.equal(s[:, 1:], amax[:, 1:] / 448)
            qmax = qf.abs().reshape(192, 64, 128)[:, 1:].amax(dim=(0, 2))
            assert qmax.eq(448).all()
    # round trip: within half an e4m3 step (2^-4 relative for normals, 2^-10 * scale absolute for subnormals)
    if fmt.granularity == "block":  # the canonical block layout: each 128-row block's scale on both 64-row halves
        canonical = s.float().repeat_interleave(2, 0)[:3]
    else:
        canonical = s.float().reshape(-1).expand(192).contiguous()
    err = (dequantize(PackedWeight(q, canonical, fmt, 192)) - w).abs()
    assert (err <= w.abs() / 16 + 2.0 ** -10 * s.float().max()).all()


def test_quantize_reference_saturates_when_a_bf16_scale_rounds_down():
    """amax / 448 just above 1.0 rounds down to 1.0 in bf16: amax / 1.0 > 448 saturates to 448, never NaN."""
    w = torch.zeros(128, K)
    w[0, 0], w[1, 1] = 448 * (1 + 2.0 ** -9), -448 * (1 + 2.0 ** -9)
    q, s = quantize_reference(w, BF16_SCALES["block"])
    assert s[0, 0].item() == 1.0 and q.float()[0, 0] == 448 and q.float()[1, 1] == -448


@pytest.mark.parametrize("w,fmt,reason", [
    (torch.ones(64, K), parse_override("bf16"), "makes fp8 checkpoints"),
    (torch.ones(K), BLOCK, "2-D floating-point"),
    (torch.ones(64, K, dtype=torch.int32), BLOCK, "2-D floating-point"),
    (torch.full((64, K), float("nan")), CHANNEL, "NaN or inf"),
    (torch.full((64, K), 1e39, dtype=torch.float64), TENSOR, "NaN or inf"),  # inf once in float32
])
def test_quantize_reference_refuses(w, fmt, reason):
    with pytest.raises(ValueError, match=reason):
        quantize_reference(w, fmt)
