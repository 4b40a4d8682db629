"""FP8 KV caches on the GPU (issue 29; marked `gpu`: run on the H200 against a cache from bench/gpu_cache.sh, which
builds the h200 plan with --kv-cache-dtype fp8 and every FP8 qkv_epilogue build).

The contract, byte for byte: an FP8 cache (float8_e4m3fn, or uint8 as vLLM allocates it) holds, at every valid slot,
e4m3_rn_satfinite(float(k_bf16) / k_scale) where k_bf16 is exactly what the bf16 path writes (same for v), and keeps
every other byte; y is the bf16 path's, bit for bit. So each call runs twice, into bf16 caches and into FP8 caches
(the same build levers: the FP8 build differs only in its cache store), and the FP8 bytes are compared with
musekern.reference.e4m3_rows of the bf16 rows, computed on the CPU (tests/test_reference.py checks e4m3_rows against
an independent fp64 rounding of every bf16 value). The bf16 rows themselves are checked against fp64 by
tests/test_gpu_qkv_front.py. Scales: 0-dim and 1-element CUDA tensors (read on the device) and Python floats.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from engine_scenario import EPS, SENTINEL, Scheduler, load_example, run_schedule, untouched_ok
from kv_layouts import SENTINEL_BYTE, paged_caches

from musekern.config import load_config
from musekern.kernels.qkv_epilogue.variant import QkvEpilogueVariant, all_builds
from musekern.ops import qkv_epilogue as epi_ops
from musekern.ops import qkv_front as ops
from musekern.reference import e4m3_rows, qkv_front_reference, rope_cos_sin_table

pytestmark = pytest.mark.gpu

K, D = 8192, 64
SHARDS = {s.tp: s for s in load_config().shards()}  # TP 1, 2, 4, 8: N = 17408, 8704, 4352, 2176
DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}
# every kind of scale an engine passes (None: 1.0)
SCALE_KINDS = ("tensor0d", "tensor1", "float", "none")
# today's GPU grid (tests/test_gpu_qkv_front.py): every decode M, and the product path's M above 16
DECODE_MS = list(range(1, 17))
PRODUCT_MS = [17, 24, 25, 31, 32, 33, 40, 41, 48, 49, 56, 63, 64, 65, 100, 128, 255, 256, 1000, 4096]


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    return {tp: (torch.randn(s.n, K, device="cuda", generator=g) / math.sqrt(K)).to(torch.bfloat16)
            for tp, s in SHARDS.items()}


def scales(kind: str, k: float = 0.0371, v: float = 0.0213):
    """(k_scale, v_scale) as the call passes them, and as floats for the expectation."""
    if kind == "tensor0d":
        return (torch.tensor(k, device="cuda"), torch.tensor(v, device="cuda")), (k, v)
    if kind == "tensor1":
        return (torch.tensor([k], device="cuda"), torch.tensor([v], device="cuda")), (k, v)
    if kind == "float":
        return (k, v), (k, v)
    return (None, None), (1.0, 1.0)


def inputs(tp, m, *, num_blocks=None, block_size=16, max_pos=4096, seed=0):
    """x, positions, cos_sin_cache, slots (every 5th -1, one past the cache, the last slot) of one call."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = num_blocks or max(8, -(-2 * m // block_size))
    cap = num_blocks * block_size
    slots = torch.randperm(cap, device="cuda", generator=g)[:m]
    slots[4::5] = -1  # from the 5th token on: M = 1..4 keep a written slot (the cases must check something)
    if m > 3:
        slots[slots == cap - 1] = -1
        slots[1], slots[2] = cap + 7, cap - 1
    x = torch.randn(m, K, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, max_pos, (m,), device="cuda", generator=g)
    return x, pos, rope_cos_sin_table(max_pos, 1e6, "cuda"), slots, num_blocks, block_size


def expect_fp8(cache16, cache8, slots, scale: float, what: str):
    """cache8 holds e4m3_rows(cache16's row, scale) at every valid slot and SENTINEL_BYTE everywhere else."""
    nb, bs = cache16.shape[0], cache16.shape[1]
    valid = sorted({s for s in slots.tolist() if 0 <= s < nb * bs})
    rows16 = cache16.reshape(nb * bs, -1).cpu()
    rows8 = cache8.view(torch.uint8).reshape(nb * bs, -1).cpu()
    assert valid, "no slot written: the case checks nothing"
    want = e4m3_rows(rows16[valid], scale).view(torch.uint8)
    bad = (rows8[valid] != want).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first (row, col) {bad[0].tolist()}: got " \
                             f"{int(rows8[valid][tuple(bad[0])]):#x}, want {int(want[tuple(bad[0])]):#x}"
    keep = torch.ones(nb * bs, dtype=torch.bool)
    keep[valid] = False
    assert bool((rows8[keep] == SENTINEL_BYTE).all()), f"{what}: a byte outside the valid slots was written"
    assert bool((rows16[keep].float() == SENTINEL).all())  # (the bf16 run too)


def run_both(weight, nkv, x, pos, cs, slots, nb, bs, layout, dtype, scale_kind, call=None):
    """The checked op into bf16 caches, then into FP8 caches with the scales: y bitwise equal, the FP8 bytes the
    contract's. `call(x, weight, ..., k_scale, v_scale)` defaults to musekern.ops.qkv_front.qkv_front."""
    call = call or (lambda *a, k_scale=None, v_scale=None: ops.qkv_front(*a, k_scale=k_scale, v_scale=v_scale))
    k16, v16, _ = paged_caches(nb, bs, nkv, layout, fill=SENTINEL, device="cuda")
    k8, v8, _ = paged_caches(nb, bs, nkv, layout, device="cuda", dtype=dtype)
    (ks, vs), (kf, vf) = scales(scale_kind)
    y16 = call(x, weight, pos, cs, slots, k16, v16, nkv, EPS)
    y8 = call(x, weight, pos, cs, slots, k8, v8, nkv, EPS, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    assert torch.equal(y8, y16), "y differs between the bf16 and the FP8 cache"
    expect_fp8(k16, k8, slots, kf, "key_cache")
    expect_fp8(v16, v8, slots, vf, "value_cache")


# Every planned build (each tile count, the M == 8 build, the wgmma builds above 16, the GEMM path's epilogue builds)
# at today's M grid on every shard; the layout, cache dtype and scale kind rotate with M so each shard sees each.
@pytest.mark.parametrize("tp", [8, 4, 2, 1])
@pytest.mark.parametrize("m", DECODE_MS + PRODUCT_MS)
def test_fp8_every_planned_build_every_m(weights, tp, m):
    s = SHARDS[tp]
    x, pos, cs, slots, nb, bs = inputs(tp, m, seed=m)
    layout = ("vllm", "flashinfer")[m % 2]
    dtype = (torch.uint8, torch.float8_e4m3fn)[(m // 2) % 2]
    run_both(weights[tp], s.num_kv_heads, x, pos, cs, slots, nb, bs, layout, dtype, SCALE_KINDS[m % 3])
    assert (s.n, m, s.num_kv_heads, torch.cuda.current_device()) in ops._RUNS_FP8  # the FP8 plan took it


# every layout x cache dtype x scale kind on the fused front (both owner epilogues: a lane a pair at M = 5 and 16,
# eight lanes a token at TP8 M = 64) and on the GEMM + epilogue path (M = 100, TP4 M = 40 is the front there)
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
@pytest.mark.parametrize("tp,m", [(8, 5), (8, 16), (8, 64), (4, 40), (8, 100)])
def test_fp8_layouts_dtypes_scales(weights, layout, dtype, scale_kind, tp, m):
    s = SHARDS[tp]
    x, pos, cs, slots, nb, bs = inputs(tp, m, seed=7 * m)
    run_both(weights[tp], s.num_kv_heads, x, pos, cs, slots, nb, bs, layout, DTYPES[dtype], scale_kind)


# scales that saturate most values at +-448 (k / 1e-3) and that send them to e4m3 subnormals and zeros (k / 50): the
# satfinite and round-to-nearest-even edges, on both paths
@pytest.mark.parametrize("ks,vs", [(1e-3, 2e-3), (50.0, 300.0), (0.3, 1e-2)])
@pytest.mark.parametrize("tp,m", [(8, 8), (8, 33), (1, 100)])
def test_fp8_saturation_and_tiny_values(weights, ks, vs, tp, m):
    s = SHARDS[tp]
    x, pos, cs, slots, nb, bs = inputs(tp, m, seed=3)
    x = x * 4  # a wider spread of v values
    k16, v16, _ = paged_caches(nb, bs, s.num_kv_heads, "vllm", fill=SENTINEL, device="cuda")
    k8, v8, _ = paged_caches(nb, bs, s.num_kv_heads, "vllm", device="cuda", dtype=torch.uint8)
    y16 = ops.qkv_front(x, weights[tp], pos, cs, slots, k16, v16, s.num_kv_heads, EPS)
    y8 = ops.qkv_front(x, weights[tp], pos, cs, slots, k8, v8, s.num_kv_heads, EPS,
                       k_scale=torch.tensor(ks, device="cuda"), v_scale=vs)
    assert torch.equal(y8, y16)
    expect_fp8(k16, k8, slots, ks, "key_cache")
    expect_fp8(v16, v8, slots, vs, "value_cache")
    sat = (k8.view(torch.uint8) & 0x7F) == 0x7E
    if ks < 1e-2:
        assert int(sat.sum()) > 0, "no value saturated: the case checks nothing"


# every FP8 qkv_epilogue build (the plan takes three; the bench and the sanitizer all eight) against the bf16 build
# of the same levers: y in place bit for bit, the cache bytes the contract's
@pytest.mark.parametrize("v", all_builds("fp8_e4m3"), ids=lambda v: v.label)
@pytest.mark.parametrize("tp,m", [(8, 1), (8, 33), (4, 1000), (1, 7)])
def test_fp8_epilogue_every_build(weights, v, tp, m):
    s = SHARDS[tp]
    x, pos, cs, slots, nb, bs = inputs(tp, m, seed=11)
    y = x @ weights[tp].t()
    bf = QkvEpilogueVariant(v.vecs_per_thread, v.rounds)

    def call(x_, w_, pos_, cs_, slots_, kc, vc, nkv, eps, k_scale=None, v_scale=None):
        out = y.clone()
        build = bf if kc.dtype == torch.bfloat16 else v
        return epi_ops.launch(out, pos_, cs_, slots_, kc, vc, nkv, eps, variant=build, k_scale=k_scale,
                              v_scale=v_scale)

    run_both(weights[tp], s.num_kv_heads, x, pos, cs, slots, nb, bs, "flashinfer", torch.uint8, "tensor1", call)


# The stores' division (kernels/qkv_front/fp8.py: one reciprocal a thread, then a clamp and two FMAs a value) against
# the true division, on the hardware: the v head of a TP8 call carries y's raw values, so 1024 rows hold all 65536
# bf16 bit patterns (NaNs, infinities, subnormals, -0 included), stored with scales across the whole positive fp32
# range (both sides of the 2^-64 / 2^64 rescaling bounds, a subnormal, the largest float), as floats and as a tensor.
# A NaN's byte is compared as a NaN (vLLM's cvt stores 0x7F whatever its sign; torch's cast keeps the sign).
@pytest.mark.parametrize("scale", [0.0371, 1.0, 2.0 ** -64, 2.0 ** 64, 2.0 ** -70, 2.0 ** 70, 3e-42, 1e-30, 1e30,
                                   3.4e38, "tensor:2**-70"])
def test_fp8_every_bf16_value_at_every_scale_range(scale):
    s = SHARDS[8]
    nq = (s.n // D - 2 * s.num_kv_heads) // 2
    m, v0 = 1024, (nq + s.num_kv_heads) * D  # 1024 rows x 64 v columns = every bf16 pattern once
    g = torch.Generator(device="cuda").manual_seed(5)
    y = torch.randn(m, s.n, device="cuda", generator=g).to(torch.bfloat16)
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(m, D)
    y[:, v0:v0 + D] = pats.to("cuda")
    sf = 2.0 ** -70 if scale == "tensor:2**-70" else scale
    arg = torch.tensor(sf, device="cuda") if isinstance(scale, str) else sf
    pos = torch.randint(0, 4096, (m,), device="cuda", generator=g)
    slots = torch.randperm(m, device="cuda", generator=g)
    k8, v8, _ = paged_caches(m // 16, 16, 1, "vllm", device="cuda", dtype=torch.uint8)
    epi_ops.qkv_epilogue(y, pos, rope_cos_sin_table(4096, 1e6, "cuda"), slots, k8, v8, 1, EPS, k_scale=1.0,
                         v_scale=arg)
    got = v8.reshape(m, D).cpu()[slots.cpu()]  # row t of the call sits at slot slots[t]
    want = e4m3_rows(pats, sf).view(torch.uint8)
    nan = pats.float().isnan()
    assert bool(((got[nan] & 0x7F) == 0x7F).all()), "a NaN was not stored as an e4m3 NaN"
    bad = ((got != want) & ~nan).nonzero()
    assert bad.numel() == 0, (f"scale {sf!r}: {bad.shape[0]} bytes differ, first at value "
                              f"{float(pats[tuple(bad[0])])!r}: got {int(got[tuple(bad[0])]):#x}, "
                              f"want {int(want[tuple(bad[0])]):#x}")


# A CUDA graph captured once reads the scale tensors' values at every replay: the scales change between replays (as
# calc_kv_scales sets them once), the caches are re-poisoned, and the bytes follow the new scales. Fused front (M = 8,
# 16) and GEMM + epilogue (M = 100).
@pytest.mark.parametrize("tp,m", [(8, 8), (4, 16), (8, 100)])
def test_fp8_graph_replay_reads_the_scales_then(weights, tp, m):
    s = SHARDS[tp]
    nkv = s.num_kv_heads
    x, pos, cs, slots, nb, bs = inputs(tp, m, seed=5)
    ops.prepare(s.n, [m], nkv, kv_cache_dtype="fp8")
    k16, v16, _ = paged_caches(nb, bs, nkv, "vllm", fill=SENTINEL, device="cuda")
    y16 = ops.qkv_front(x, weights[tp], pos, cs, slots, k16, v16, nkv, EPS)
    k8, v8, kv8 = paged_caches(nb, bs, nkv, "vllm", device="cuda", dtype=torch.float8_e4m3fn)
    ks, vs = torch.tensor(1.0, device="cuda"), torch.tensor([1.0], device="cuda")
    out = torch.empty_like(y16)
    ops.qkv_front(x, weights[tp], pos, cs, slots, k8, v8, nkv, EPS, out=out, k_scale=ks, v_scale=vs)  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.qkv_front(x, weights[tp], pos, cs, slots, k8, v8, nkv, EPS, out=out, k_scale=ks, v_scale=vs)
    for kf, vf in ((0.0371, 0.0213), (0.5, 4.0), (1e-3, 7.0)):
        kv8.view(torch.uint8).fill_(SENTINEL_BYTE)
        out.fill_(0)
        ks.fill_(kf)
        vs.fill_(vf)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y16)
        expect_fp8(k16, k8, slots, kf, f"key_cache after the scale became {kf}")
        expect_fp8(v16, v8, slots, vf, f"value_cache after the scale became {vf}")


def _layer_args(weights, tp, m, seed):
    s = SHARDS[tp]
    x, pos, cs, slots, nb, bs = inputs(tp, m, seed=seed, num_blocks=64)
    kv = torch.full((2, nb, bs, s.num_kv_heads, D), SENTINEL_BYTE, dtype=torch.uint8, device="cuda")
    return [x, weights[tp], pos, cs, slots, kv, torch.tensor(0.05, device="cuda"), torch.tensor(0.03, device="cuda")]


@pytest.mark.parametrize("m", [5, 40])
def test_fp8_opcheck_cuda(weights, m):
    a = _layer_args(weights, 8, m, seed=m)
    kc, vc = a[5].unbind(0)  # uint8 caches (opcheck's schema test does arithmetic torch lacks for float8)
    torch.library.opcheck(torch.ops.musekern.qkv_front.default, (*a[:5], kc, vc, SHARDS[8].num_kv_heads, EPS, a[6],
                                                                 a[7]))


class Fp8Views(torch.nn.Module):
    """The op with float8 cache views made outside the compiled region. (Made inside, `kv.view(float8).unbind(0)` of
    one uint8 cache reaches the op as one buffer twice under inductor (torch 2.11, seen on the H200): the op refuses
    two caches at one address.)"""

    def forward(self, x, weight, positions, cos_sin_cache, slot_mapping, kc, vc, k_scale, v_scale):
        return torch.ops.musekern.qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, kc, vc, kc.shape[2],
                                            EPS, k_scale, v_scale)


def test_fp8_fullgraph_compile_matches_eager_bitwise(weights):
    """Inductor, fullgraph, M marked dynamic: y and the cache bytes equal eager's, at the front's M and the GEMM
    path's."""
    layer = Fp8Views()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (5, 12, 40, 100):
        eager_args = _layer_args(weights, 8, m, seed=m)
        comp_args = [t.clone() if t.dtype == torch.uint8 else t for t in eager_args]
        views = [[*a[:5], *a[5].view(torch.float8_e4m3fn).unbind(0), a[6], a[7]] for a in (eager_args, comp_args)]
        want = layer(*views[0])
        got = compiled(*views[1])
        torch.cuda.synchronize()
        assert torch.equal(got, want) and torch.equal(comp_args[5], eager_args[5]), f"M={m}"


# ---------------------------------------------------------------- a decode run reading the FP8 cache back
class Fp8Block(torch.nn.Module):
    """examples/decode_attention.py's block with an FP8 cache: the front writes e4m3 with the scales, attention reads
    the cache back dequantized (e4m3 * scale, in float32), as an engine's FP8 attention does."""

    def __init__(self, inner, k_scale: float, v_scale: float):
        super().__init__()
        self.inner = inner
        dev = inner.kv.device
        self.kv = torch.full(inner.kv.shape, SENTINEL_BYTE, dtype=torch.uint8, device=dev)
        self.k_scale, self.v_scale = torch.tensor(k_scale, device=dev), torch.tensor(v_scale, device=dev)

    def forward(self, hidden, positions, slot_mapping, block_tables, token_request):
        ex, b = load_example(), self.inner
        m = hidden.shape[0]
        kc, vc = ex.cache_views(self.kv.view(torch.float8_e4m3fn), b.layout)
        x = ex.rms_norm(hidden, b.norm_weight, b.rms_eps)
        y = b.front(x, b.qkv_weight, positions, b.cos_sin_cache, slot_mapping, kc, vc, b.nkv, b.qk_eps,
                    k_scale=self.k_scale, v_scale=self.v_scale)
        heads = y.view(m, -1, D)
        q, gate = heads[:, :b.nq], heads[:, b.nq + 2 * b.nkv:]
        attn = ex.paged_attention(q.float(), kc.float() * self.k_scale, vc.float() * self.v_scale,
                                  block_tables[token_request], positions).to(torch.bfloat16)
        gated = (attn.float() * torch.sigmoid(gate.float())).to(attn.dtype)
        return torch.nn.functional.linear(gated.reshape(m, b.nq * D), b.o_weight)


@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_fp8_decode_run_matches_the_float32_oracle(record_property, layout):
    """A multi-request run (prefill, decode steps at M = 1..16 and above, joins and leaves, padded steps) through the
    FP8 block and the same block with torch's front + the reference's e4m3 (musekern.reference): both against the
    float32 oracle with dense float K/V. The block's error stays within 2x the reference block's plus one bf16
    rounding (the house rule), and the FP8 error itself is bounded (3-bit mantissas: a few percent of the output)."""
    from engine_scenario import DenseFloat32Block

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ex, cfg = load_example(), load_config()
        shard = cfg.shard(8)
        w = ex.random_weights(shard, cfg.hidden_size, 0, "cuda")
        kw = dict(num_blocks=256, block_size=16, layout=layout, max_pos=4096, rope_theta=cfg.rope_theta,
                  qk_eps=cfg.rms_norm_eps, rms_eps=cfg.rms_norm_eps)
        # k after the norm is O(1) (k / 0.02 <= ~300 < 448), v O(1): scales that use e4m3's range without saturating
        block = Fp8Block(ex.DecoderAttentionBlock(w, shard, **kw), 0.0213, 0.0197)
        ref = Fp8Block(ex.DecoderAttentionBlock(w, shard, front=qkv_front_reference, **kw), 0.0213, 0.0197)
        dense = DenseFloat32Block(w, shard.num_q_heads, shard.num_kv_heads, block.inner.cos_sin_cache,
                                  cfg.rms_norm_eps, cfg.rms_norm_eps)
        sched = Scheduler(256, 16, 16, cfg.hidden_size, 0)
        sizes = [4, 3, 8, 12, 16, 17, 24, 19, 16, 9, 4, 1, 1, 3, 8, 16, 17, 6, 1]
        recs = []
        for st, left in run_schedule(sched, [97, 150, 33, 20], sizes):
            for rid in left:
                dense.leave(rid)
            args = st.inputs("cuda")
            before = block.kv.clone()
            got = block(*args)[:st.real].float()
            want_ref = ref(*args)[:st.real].float()
            want = dense.step(st, "cuda")
            scale = want.abs().max().item()
            err, ref_err = (got - want).abs().max().item(), (want_ref - want).abs().max().item()
            recs.append(dict(m=st.m, real=st.real, err=err, ref_err=ref_err, scale=scale,
                             untouched=untouched_ok(before, block.kv, st.slot_mapping, layout)))
        record_property("steps", json.dumps(recs))
        assert recs[0]["real"] == 300 and {r["real"] for r in recs} & set(range(1, 17)) and max(
            r["real"] for r in recs) > 16
        for i, r in enumerate(recs):
            assert r["untouched"], f"step {i}: a cache row outside the step's slots changed"
            assert r["err"] <= 2 * r["ref_err"] + 2.0 ** -8 * r["scale"], f"step {i}: {r}"
            assert r["ref_err"] <= 0.1 * r["scale"], f"step {i}: the FP8 reference block itself is off: {r}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
