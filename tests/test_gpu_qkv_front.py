"""qkv_front on the GPU (marked `gpu`; run on the H200 against a cache built on the CPU machine).

Correctness is judged against an fp64 pipeline (GEMM, norm, RoPE in float64): the kernel's error
must be at most 2x the error of torch's own bf16 path (the reference: bf16 GEMM, fp32 epilogue)
plus a tiny atol. Outputs are poisoned before every launch; caches are poisoned with a sentinel
and checked bit for bit outside the given slots.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch
from qkv_front_builds import front_candidates, other_warp_split, same_bits_alternatives

from musekern.config import load_config
from musekern.ops import qkv_front as ops
from musekern.reference import bf16_step, qkv_front_reference, rope_cos_sin_table

pytestmark = pytest.mark.gpu

HIDDEN = 8192
HD = 64
EPS = 1e-5
SENTINEL = -7.0  # exact in bf16: a cache element that still holds it was never written
MODEL = load_config()
SHARDS = {s.tp: s for s in MODEL.shards()}  # TP 1, 2, 4, 8: N = 17408, 8704, 4352, 2176
ATOL = 1e-3


@pytest.fixture(scope="module")
def weights():
    """One bf16 weight per planned N (std 1/sqrt(K): y has unit scale), made once."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return {tp: (torch.randn(s.n, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5).to(torch.bfloat16)
            for tp, s in SHARDS.items()}


def make_caches(num_blocks, block_size, nkv, layout):
    """bf16 K/V caches poisoned with SENTINEL, in the layouts serving engines use."""
    shape = (num_blocks, block_size, nkv, HD)
    if layout == "vllm":  # [2, blocks, block_size, heads, 64]: each cache contiguous
        kv = torch.full((2, *shape), SENTINEL, dtype=torch.bfloat16, device="cuda")
        return kv[0], kv[1], kv
    if layout == "flashinfer":  # [blocks, 2, block_size, heads, 64] NHD: block stride 2x the block
        kv = torch.full((num_blocks, 2, block_size, nkv, HD), SENTINEL, dtype=torch.bfloat16, device="cuda")
        return kv[:, 0], kv[:, 1], kv
    raise ValueError(layout)


def problem(m, nkv, *, num_blocks=64, block_size=16, layout="vllm", max_pos=4096, pad_every=0, seed=0,
            positions=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    if positions is None:
        positions = torch.randint(0, max_pos, (m,), device="cuda", generator=g)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=g)[:m]
    if pad_every:
        slots[::pad_every] = -1
    kc, vc, backing = make_caches(num_blocks, block_size, nkv, layout)
    return dict(x=x, positions=positions.long(), cos_sin_cache=rope_cos_sin_table(max_pos, MODEL.rope_theta, "cuda"),
                slot_mapping=slots.long(), key_cache=kc, value_cache=vc, backing=backing)


def truth64(p, weight, nkv):
    """y, and the (k, v) rows per token, in float64 from the same bf16 inputs."""
    y = p["x"].double() @ weight.double().t()
    m, n = y.shape
    heads = n // HD
    nq = (heads - 2 * nkv) // 2
    y = y.reshape(m, heads, HD)
    qk = y[:, :nq + nkv]
    qk = qk / torch.sqrt(qk.pow(2).mean(-1, keepdim=True) + EPS)
    pos = p["positions"].clamp(0, p["cos_sin_cache"].shape[0] - 1)
    cs = p["cos_sin_cache"].double()[pos]
    c, s = cs[:, None, :HD // 2], cs[:, None, HD // 2:]
    a, b = qk[..., 0::2], qk[..., 1::2]
    y[:, :nq + nkv] = torch.stack((a * c - b * s, a * s + b * c), -1).reshape(m, nq + nkv, HD)
    return y.reshape(m, n), y[:, nq:nq + nkv], y[:, nq + nkv:nq + 2 * nkv]


def run_kernel(p, weight, nkv, out=None):
    if out is None:
        out = torch.full((p["x"].shape[0], weight.shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
    ops.qkv_front(p["x"], weight, p["positions"], p["cos_sin_cache"], p["slot_mapping"], p["key_cache"],
                  p["value_cache"], nkv, EPS, out=out)
    return out


def cache_rows(cache, slots):
    """The cache rows of the valid slots, [T, nkv, 64], and the token indices they belong to."""
    nb, bs = cache.shape[0], cache.shape[1]
    idx = [(t, s) for t, s in enumerate(slots.tolist()) if 0 <= s < nb * bs]
    rows = torch.stack([cache[s // bs, s % bs] for _, s in idx]) if idx else cache.new_empty(0)
    return rows, [t for t, _ in idx]


def check_untouched(cache, slots, name):
    """Every row outside the valid slots still holds the sentinel, bit for bit."""
    nb, bs = cache.shape[0], cache.shape[1]
    mask = torch.ones(nb * bs, dtype=torch.bool, device=cache.device)
    for s in slots.tolist():
        if 0 <= s < nb * bs:
            mask[s] = False
    rest = cache.reshape(nb * bs, -1)[mask]
    assert torch.all(rest == SENTINEL), f"{name}: written outside the given slots"


def check_against_truth(p, weight, nkv, y, record_property=None):
    """Kernel error vs fp64 <= 2x torch's bf16 error + atol, for y, k cache and v cache."""
    ty, tk, tv = truth64(p, weight, nkv)
    # torch's own bf16 path, on copies of the (poisoned) caches
    kc_ref, vc_ref = p["key_cache"].clone(), p["value_cache"].clone()
    y_ref = qkv_front_reference(p["x"], weight, p["positions"], p["cos_sin_cache"], p["slot_mapping"], kc_ref,
                                vc_ref, nkv, EPS)
    assert not torch.isnan(y).any(), "y not fully written"
    errs = {}
    for name, got, ref in (("y", y, y_ref),):
        e_k, e_t = (got.double() - ty).abs().max().item(), (ref.double() - ty).abs().max().item()
        errs[name] = (e_k, e_t)
    for name, cache, ref_cache, t in (("key_cache", p["key_cache"], kc_ref, tk),
                                      ("value_cache", p["value_cache"], vc_ref, tv)):
        rows, toks = cache_rows(cache, p["slot_mapping"])
        ref_rows, _ = cache_rows(ref_cache, p["slot_mapping"])
        check_untouched(cache, p["slot_mapping"], name)
        if toks:
            want = t[toks]
            errs[name] = ((rows.double() - want).abs().max().item(), (ref_rows.double() - want).abs().max().item())
    for name, (e_k, e_t) in errs.items():
        if record_property:
            record_property(f"{name}_err", e_k)
            record_property(f"{name}_torch_err", e_t)
        assert e_k <= 2 * e_t + ATOL, f"{name}: kernel error {e_k:.3e} > 2 x torch's {e_t:.3e} + {ATOL}"
    return errs


# Every M of 1..16 for each TP shard of the default model (the planned N's): all three compiled
# variants per N (tiles 1, the M == 8 build, tiles 2) and every tail inside a tile.
@pytest.mark.parametrize("tp", [8, 4, 2, 1])
@pytest.mark.parametrize("m", list(range(1, 17)))
def test_every_m_every_planned_n(weights, record_property, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    p = problem(m, nkv, seed=100 * tp + m)
    y = run_kernel(p, weights[tp], nkv)
    torch.cuda.synchronize()
    check_against_truth(p, weights[tp], nkv, y, record_property)


# The product call (musekern.qkv_front: the fused front or cuBLAS + the fused epilogue, by the planner's rule) at the
# issue's M grid above 16 on every planned N: each side of every tile count (3 to 6 and 8 tiles), of the front's
# range (64 / 65; TP2 48 / 49, TP1 16 / 17) and of the epilogue's build switch, rows that end mid-CTA, and prefill
# sizes; against fp64, the caches bit for bit outside the slots, with no host sync (sync debug mode "error"). Both
# cache layouts alternate over M.
PRODUCT_MS = [17, 24, 25, 31, 32, 33, 40, 41, 48, 49, 56, 63, 64, 65, 100, 128, 255, 256, 1000, 4096]


@pytest.mark.parametrize("tp", [8, 4, 2, 1])
@pytest.mark.parametrize("m", PRODUCT_MS)
def test_product_path_every_m_no_host_sync(weights, record_property, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    layout = ("vllm", "flashinfer")[PRODUCT_MS.index(m) % 2]
    p = problem(m, nkv, num_blocks=max(64, m // 8), layout=layout, pad_every=7, seed=500 * tp + m)
    y = torch.full((m, SHARDS[tp].n), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_kernel(p, weights[tp], nkv, out=y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    record_property("path", "front" if ops._fused(SHARDS[tp].n, m, torch.cuda.current_device()) else "gemm")
    check_against_truth(p, weights[tp], nkv, y, record_property)


# Both engine layouts (non-contiguous block stride for FlashInfer), padding slots (-1) and a slot past
# the end of the cache (written nowhere), at the TP8 and TP4 shapes.
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("tp,m", [(8, 5), (8, 16), (4, 8), (4, 13)])
def test_cache_layouts_padding_and_bad_slots(weights, layout, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    p = problem(m, nkv, layout=layout, pad_every=3, seed=7 * m + tp)
    nb, bs = p["key_cache"].shape[:2]
    p["slot_mapping"][-1] = nb * bs + 5  # beyond the cache: must write nothing
    if layout == "flashinfer":
        assert not p["key_cache"].is_contiguous()
    y = run_kernel(p, weights[tp], nkv)
    torch.cuda.synchronize()
    check_against_truth(p, weights[tp], nkv, y)


@pytest.mark.parametrize("tp", [8, 1])
def test_positions_near_and_past_the_end_of_the_table(weights, tp):
    """Positions up to max_pos - 1 are exact; outside [0, max_pos) they are clamped (documented)."""
    nkv = SHARDS[tp].num_kv_heads
    max_pos = 512
    pos = torch.tensor([511, 510, 0, 1, 509, 511, 600, -3, 2**40, 255], device="cuda")
    p = problem(len(pos), nkv, max_pos=max_pos, positions=pos, seed=3)
    y = run_kernel(p, weights[tp], nkv)
    torch.cuda.synchronize()
    check_against_truth(p, weights[tp], nkv, y)


@pytest.mark.parametrize("tp,m", [(8, 1), (8, 8), (8, 16), (1, 11)])
def test_bitwise_deterministic_20_launches(weights, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    p = problem(m, nkv, seed=11)
    first = run_kernel(p, weights[tp], nkv).clone()
    k0 = p["backing"].clone()
    for _ in range(20):
        assert torch.equal(run_kernel(p, weights[tp], nkv), first)
        assert torch.equal(p["backing"], k0)


# warp_split "rows" vs "k" (how the 4 consumer warps share a k-tile) changes the summation order: the build
# the planner does not pick, against the fp64 pipeline at every planned N and both tile counts, repeated
# bitwise, and at a second ring depth bit for bit (gpu_cache.sh builds both).
@pytest.mark.parametrize("tp,m", [(8, 1), (8, 8), (8, 16), (4, 5), (4, 16), (2, 9), (1, 3), (1, 16)])
def test_other_warp_split_is_correct_deterministic_and_ring_independent(weights, tp, m):
    from musekern.kernels.qkv_front.rules import variant
    from musekern.targets import local_target

    nkv = SHARDS[tp].num_kv_heads
    v = other_warp_split(variant(SHARDS[tp].n, m, nkv, local_target()))
    p = problem(m, nkv, seed=17 + m)
    y = _launch_variant(v, p, weights[tp], torch.full((m, SHARDS[tp].n), float("nan"), dtype=torch.bfloat16,
                                                      device="cuda")).clone()
    torch.cuda.synchronize()
    check_against_truth(p, weights[tp], nkv, y)
    again = _launch_variant(v, p, weights[tp], torch.full_like(y, float("nan")))
    alt = same_bits_alternatives(v)["stages"]
    shallow = _launch_variant(alt, p, weights[tp], torch.full_like(y, float("nan")))
    torch.cuda.synchronize()
    assert torch.equal(again, y)
    assert torch.equal(shallow, y), f"{v.label}: ring depth {alt.stages} changed the result"


# Caches with >= 2^31 slots take a 64-bit slot division, all others a 32-bit one: the same launch with a
# num_blocks that only moves the bound past 2^31 (the slots stay inside the real cache) must write the same bits. Both
# epilogues: a lane per RoPE pair (M = 5, 16, and the 3-tile builds' 12 owned tokens, M = 20) and eight lanes a token
# (the wgmma builds with 16 owned tokens or more: TP8 4 and 8 tiles, TP4 5 and 6 tiles).
@pytest.mark.parametrize("tp,m", [(8, 5), (1, 16), (8, 20), (8, 30), (8, 64), (4, 40), (4, 44)])
def test_huge_cache_slot_path_matches(weights, tp, m):
    from musekern.kernels.qkv_front.rules import variant
    from musekern.kernels.qkv_front.variant import launch_grid
    from musekern.runtime import get_kernel
    from musekern.targets import local_target

    nkv = SHARDS[tp].num_kv_heads
    v = variant(SHARDS[tp].n, m, nkv, local_target())
    results = []
    for num_blocks in (None, 2**27 + 64):  # 2^27 blocks x 16 = 2^31 slots
        p = problem(m, nkv, seed=23)
        out = torch.full((m, SHARDS[tp].n), float("nan"), dtype=torch.bfloat16, device="cuda")
        args = ops.launch_args(p["x"], weights[tp], p["positions"], p["cos_sin_cache"], p["slot_mapping"],
                               p["key_cache"], p["value_cache"], EPS, out)
        if num_blocks:
            args["num_blocks"] = num_blocks
        get_kernel(v).launch(launch_grid(v), args)
        torch.cuda.synchronize()
        results.append((out, p["backing"]))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def _launch_variant(v, p, weight, out):
    from musekern.kernels.qkv_front.variant import launch_grid
    from musekern.runtime import get_kernel

    get_kernel(v).launch(launch_grid(v), ops.launch_args(p["x"], weight, p["positions"], p["cos_sin_cache"],
                                                          p["slot_mapping"], p["key_cache"], p["value_cache"], EPS,
                                                          out))
    return out


# TP8 (one tile "rows" under "late", and two tiles "k"; M = 8 its own build) and TP4 ("k" under "exit"); every
# lever that applies to the planned build (trigger_ahead: "late" only), and TP2's one-tile "late" build for
# trigger_ahead (planned 0 there: the alternative fires 4 k-tiles ahead).
BIT_LEVERS = [(tp, m, what) for tp, m in ((8, 3), (8, 8), (8, 12), (4, 16)) for what in ("stages", "trigger")] \
    + [(8, 3, "trigger_ahead"), (8, 8, "trigger_ahead"), (8, 12, "trigger_ahead"), (2, 5, "trigger_ahead")]


@pytest.mark.parametrize("tp,m,what", BIT_LEVERS)
def test_ring_stages_and_trigger_do_not_change_a_bit(weights, tp, m, what):
    """Builds that differ only in ring depth, PDL trigger or trigger_ahead give identical bits
    (tests/qkv_front_builds.py::same_bits_alternatives; gpu_cache.sh builds them)."""
    from musekern.kernels.qkv_front.rules import variant
    from musekern.targets import local_target

    nkv = SHARDS[tp].num_kv_heads
    v = variant(SHARDS[tp].n, m, nkv, local_target())
    alts = same_bits_alternatives(v)
    assert what in alts, f"{what} does not apply to {v.label}: fix BIT_LEVERS"
    alt = alts[what]
    p = problem(m, nkv, seed=5)
    a = _launch_variant(v, p, weights[tp], torch.full((m, SHARDS[tp].n), float("nan"), dtype=torch.bfloat16,
                                                      device="cuda")).clone()
    b = _launch_variant(alt, p, weights[tp], torch.full_like(a, float("nan")))
    torch.cuda.synchronize()
    assert torch.equal(a, b), f"{v.label} vs {alt.label} differ"



# ---------------------------------------------------------------- above M = 16 (3 to 8 token tiles: wgmma)
# These launch the builds the rules give M = 17..64 directly, on every shard (front_serves takes them at TP8, TP4 and
# TP2; bench/gpu_cache.sh and bench/front_large_m.py build them). Every M (every tail of every new tile count) at TP8
# and TP4; each end of every tile count and a middle at TP2 and TP1.
ABOVE_16 = ([(tp, m) for tp in (8, 4) for m in range(17, 65)]
            + [(tp, m) for tp in (2, 1) for m in (17, 21, 24, 25, 31, 32, 33, 40, 41, 48, 49, 56, 57, 64)])


def _front(tp, m):
    from musekern.kernels.qkv_front.rules import variant
    from musekern.targets import local_target

    return variant(SHARDS[tp].n, m, SHARDS[tp].num_kv_heads, local_target())


def _poisoned(m, tp):
    return torch.full((m, SHARDS[tp].n), float("nan"), dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("tp,m", ABOVE_16)
def test_above_16_every_m(weights, record_property, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    p = problem(m, nkv, seed=300 * tp + m)
    y = _launch_variant(_front(tp, m), p, weights[tp], _poisoned(m, tp))
    torch.cuda.synchronize()
    check_against_truth(p, weights[tp], nkv, y, record_property)


# Both engine layouts, padding slots (-1), a slot past the end and the last slot of the cache, positions 0 and
# max_pos - 1, at every shard.
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("tp,m", [(8, 17), (8, 32), (8, 47), (8, 64), (4, 29), (4, 37), (4, 52), (2, 32), (2, 36),
                                  (2, 64), (1, 24), (1, 40)])
def test_above_16_cache_layouts_padding_and_edges(weights, layout, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    max_pos = 4096
    pos = torch.randint(0, max_pos, (m,), device="cuda")
    pos[0], pos[-2] = 0, max_pos - 1
    p = problem(m, nkv, layout=layout, pad_every=5, seed=11 * m + tp, positions=pos)
    nb, bs = p["key_cache"].shape[:2]
    p["slot_mapping"][-1] = nb * bs + 5  # beyond the cache: must write nothing
    p["slot_mapping"][1] = nb * bs - 1  # the last slot
    y = _launch_variant(_front(tp, m), p, weights[tp], _poisoned(m, tp))
    torch.cuda.synchronize()
    check_against_truth(p, weights[tp], nkv, y)


@pytest.mark.parametrize("tp,m", [(8, 32), (8, 64), (4, 17), (4, 32), (4, 37), (4, 45), (2, 25), (2, 36), (2, 60),
                                  (1, 17), (1, 64)])
def test_above_16_bitwise_deterministic(weights, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    v = _front(tp, m)
    p = problem(m, nkv, seed=31)
    first = _launch_variant(v, p, weights[tp], _poisoned(m, tp)).clone()
    k0 = p["backing"].clone()
    for _ in range(10):
        assert torch.equal(_launch_variant(v, p, weights[tp], _poisoned(m, tp)), first)
        assert torch.equal(p["backing"], k0)


def _levers(cases):
    """(tp, m, lever) for every lever that applies to the build of (tp, m) (tests/qkv_front_builds.py)."""
    from musekern.kernels.qkv_front.rules import variant
    from musekern.targets import get_target

    return [(tp, m, what) for tp, m in cases for what in same_bits_alternatives(
        variant(SHARDS[tp].n, m, SHARDS[tp].num_kv_heads, get_target("h200")))]


# every lever of every build above 16 tokens that must not change a bit (one M per planned build, and TP1's)
@pytest.mark.parametrize("tp,m,what", _levers(((8, 24), (8, 30), (8, 40), (8, 64), (4, 32), (4, 19), (4, 37), (4, 48),
                                                (4, 61), (2, 20), (2, 30), (2, 36), (2, 44), (1, 32), (1, 56))))
def test_above_16_levers_do_not_change_a_bit(weights, tp, m, what):
    v = _front(tp, m)
    alts = same_bits_alternatives(v)
    p = problem(m, SHARDS[tp].num_kv_heads, seed=5)
    a = _launch_variant(v, p, weights[tp], _poisoned(m, tp)).clone()
    b = _launch_variant(alts[what], p, weights[tp], _poisoned(m, tp))
    torch.cuda.synchronize()
    assert torch.equal(a, b), f"{v.label} vs {alts[what].label} differ"


# the warp split the plan did not pick: correct against fp64, deterministic, independent of the ring depth (the
# 4-tile builds: an odd tile count has no mma.sync build)
@pytest.mark.parametrize("tp,m", [(8, 26), (4, 32), (4, 27), (2, 31), (1, 27)])
def test_above_16_other_warp_split(weights, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    v = other_warp_split(_front(tp, m))  # 4 tiles: the mma.sync "k" build beside wgmma
    p = problem(m, nkv, seed=41 + m)
    y = _launch_variant(v, p, weights[tp], _poisoned(m, tp)).clone()
    torch.cuda.synchronize()
    check_against_truth(p, weights[tp], nkv, y)
    again = _launch_variant(v, p, weights[tp], _poisoned(m, tp))
    alt = same_bits_alternatives(v)["stages"]
    shallow = _launch_variant(alt, p, weights[tp], _poisoned(m, tp))
    torch.cuda.synchronize()
    assert torch.equal(again, y)
    assert torch.equal(shallow, y), f"{v.label}: ring depth {alt.stages} changed the result"


def _candidates():
    from musekern.targets import get_target

    return front_candidates(get_target("h200"))


# the alternatives bench/front_large_m.py times beside the plan: each against fp64 at its M and at a tail
@pytest.mark.parametrize("name,v,m", _candidates(), ids=lambda x: x if isinstance(x, str) else "")
def test_above_16_candidates(weights, name, v, m):
    tp = int(name.split("-")[0][2:])
    nkv = SHARDS[tp].num_kv_heads
    for mm in (m, m - 11):
        p = problem(mm, nkv, seed=51 + mm)
        y = _launch_variant(v, p, weights[tp], _poisoned(mm, tp)).clone()
        torch.cuda.synchronize()
        check_against_truth(p, weights[tp], nkv, y)
        if v.x_mcast:  # two heads share each x tile: still one fixed result
            assert torch.equal(_launch_variant(v, p, weights[tp], _poisoned(mm, tp)), y)


@pytest.mark.parametrize("tp,m", [(8, 4), (8, 8), (2, 16)])
def test_graph_replay_equals_eager(weights, tp, m):
    nkv = SHARDS[tp].num_kv_heads
    p = problem(m, nkv, seed=9)
    eager = run_kernel(p, weights[tp], nkv).clone()
    ops.prepare(SHARDS[tp].n, m, num_kv_heads=nkv)
    assert_graph_replays(lambda out: run_kernel(p, weights[tp], nkv, out=out), eager)


def assert_graph_replays(run, eager):
    """`run(out)` warmed on a side stream, captured there, replayed 3 times into a NaN-poisoned out: eager's bits."""
    out = torch.empty_like(eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        run(out)  # warm on the capture stream
        with torch.cuda.graph(g, stream=s):
            run(out)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


# ---------------------------------------------------------------- PDL
PRED_SRC = r"""
#include <cuda_bf16.h>
// A predecessor that lets its dependents launch at once, then waits ~spin_ns and only then writes x:
// a front that read x before griddepcontrol.wait would see the old x.
extern "C" __global__ void pred_write_x(__nv_bfloat16* x, const __nv_bfloat16* src, int n, long long spin_ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = src[i];
}
"""


@pytest.fixture(scope="module")
def pred_kernel(tmp_path_factory):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.skip("nvcc is needed to build the PDL predecessor")
    d = tmp_path_factory.mktemp("pred")
    (d / "pred.cu").write_text(PRED_SRC)
    subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(d / "pred.cubin"),
                    str(d / "pred.cu")], check=True)
    from cuda.bindings import driver as drv

    from musekern.runtime.driver import check

    mod = check(drv.cuModuleLoadData((d / "pred.cubin").read_bytes()), "cuModuleLoadData")
    return check(drv.cuModuleGetFunction(mod, b"pred_write_x"), "cuModuleGetFunction")


def test_pdl_front_sees_the_x_its_predecessor_writes(weights, pred_kernel):
    """100 times: predecessor triggers dependents early, spins, then writes x; the front must use the new x."""
    import ctypes

    from cuda.bindings import driver as drv

    from musekern.runtime.driver import check

    tp, m = 8, 8
    nkv = SHARDS[tp].num_kv_heads
    p = problem(m, nkv, seed=21)
    srcs = [torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(2)]
    expect = []
    for src in srcs:
        p["x"].copy_(src)
        expect.append(run_kernel(p, weights[tp], nkv).clone())
    assert not torch.equal(expect[0], expect[1])
    out = torch.empty_like(expect[0])
    hs = torch.cuda.current_stream().cuda_stream
    n = m * HIDDEN
    for i in range(100):
        src = srcs[i % 2]
        p["x"].copy_(srcs[1 - i % 2])  # the stale x
        out.fill_(float("nan"))
        args = [ctypes.c_uint64(p["x"].data_ptr()), ctypes.c_uint64(src.data_ptr()), ctypes.c_int(n),
                ctypes.c_longlong(20_000)]
        ptrs = (ctypes.c_void_p * 4)(*[ctypes.addressof(a) for a in args])
        check(drv.cuLaunchKernel(pred_kernel, 8, 1, 1, 256, 1, 1, 0, hs, ctypes.addressof(ptrs), 0),
              "cuLaunchKernel(pred)")
        run_kernel(p, weights[tp], nkv, out=out)  # launched with PDL: may start while pred spins
        torch.cuda.synchronize()
        assert torch.equal(out, expect[i % 2]), f"iteration {i}: the front did not see its predecessor's x"


def test_no_cutlass_on_the_launch_path():
    assert "cutlass" not in sys.modules


# ---------------------------------------------------------------- FP8 weights (issue 30)
# The weight: each planned shard's bf16 weight quantized as a checkpoint stores it (pack.quantize_reference), in the
# canonical layout (pack.py): "channel" scales [N], "block" ones [N // 64, 64] (each 128-row block's scale on both
# of its 64-row halves). Truth: fp64 of x @ dequant(W)^T, then the norm and RoPE in fp64 (truth64). Two bounds on
# y and the written K/V: the file's split-K idiom against the reference on the same weight (fp32 GEMM of the
# dequantized weight, x unrounded: kernel error <= 2x its error + ATOL), and the issue's: no larger than vLLM's
# Hopper chain on the same inputs (x quantized per token / per 128-group, the exact scaled product rounded to fp32
# then bf16, the same fp32 epilogue).
@pytest.fixture(scope="module")
def fp8_weights(weights):
    from musekern.weights.formats import parse_override
    from musekern.weights.pack import PackedWeight, quantize_reference

    made = {}

    def get(tp, mode):
        if (tp, mode) not in made:
            fmt = parse_override("fp8-channel" if mode == "channel" else "fp8-block")
            w, s = quantize_reference(weights[tp], fmt)
            n = w.shape[0]
            s = s.reshape(n) if mode == "channel" else s.repeat_interleave(2, 0)[:n // HD].contiguous()
            made[tp, mode] = PackedWeight(w, s, fmt, n)
        return made[tp, mode]

    return get


def dequant64(pw):
    """The canonical pair in fp64 (written here from pack.py's layout, not with its code)."""
    w, s, n = pw.weight.double(), pw.weight_scale.double(), pw.n
    if s.dim() == 1:
        return w * s[:, None]
    return (w.reshape(n // HD, HD, HIDDEN // 128, 128) * s[:, None, :, None]).reshape(n, HIDDEN)


def run_w8(p, pw, nkv, out=None):
    if out is None:
        out = torch.full((p["x"].shape[0], pw.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ops.qkv_front(p["x"], pw.weight, p["positions"], p["cos_sin_cache"], p["slot_mapping"], p["key_cache"],
                  p["value_cache"], nkv, EPS, out=out, weight_scale=pw.weight_scale)
    return out


def max_abs(d):
    return d.abs().max().item()


def rms(d):
    return d.pow(2).mean().sqrt().item()


def w8_chain(p, pw, nkv, gemm):
    """(y, key_cache, value_cache) of a GEMM model's fp32 y rounded to bf16, then the fused epilogue reference on
    fresh copies of the caches (vLLM's order: the GEMM's bf16 output is what its norm / RoPE / insert read)."""
    from musekern.reference import fused_qknorm_rope_kv_insert

    caches = (p["key_cache"].clone(), p["value_cache"].clone())
    y = fused_qknorm_rope_kv_insert(gemm(p["x"], pw).to(torch.bfloat16), p["positions"], p["cos_sin_cache"],
                                    p["slot_mapping"], *caches, nkv, EPS)
    return (y, *caches)


def chain_errors(p, outs, truth, stat=max_abs):
    """{name: (stat of each output's error)} against the fp64 truth (y, k rows, v rows), for y and the caches'
    written rows; outs = [(y, key_cache, value_cache), ...]."""
    assert not any(torch.isnan(o[0]).any() for o in outs), "y not fully written"
    errs = {"y": tuple(stat(o[0].double() - truth[0]) for o in outs)}
    for i, name in enumerate(("key_cache", "value_cache")):
        toks = cache_rows(outs[0][i + 1], p["slot_mapping"])[1]
        if toks:
            errs[name] = tuple(stat(cache_rows(o[i + 1], p["slot_mapping"])[0].double() - truth[i + 1][toks])
                               for o in outs)
    return errs


def w8_errors(p, pw, nkv, y, record_property):
    """{name: (kernel error, reference error, vLLM chain error)} against fp64, for y and the two caches' written rows
    (and every other cache row still the sentinel), each recorded in the junit XML."""
    from musekern.reference import vllm_fp8_gemm

    truth = truth64(p, dequant64(pw), nkv)
    ref_c = (p["key_cache"].clone(), p["value_cache"].clone())
    y_ref = qkv_front_reference(p["x"], pw.weight, p["positions"], p["cos_sin_cache"], p["slot_mapping"], *ref_c,
                                nkv, EPS, weight_scale=pw.weight_scale)
    for name in ("key_cache", "value_cache"):
        check_untouched(p[name], p["slot_mapping"], name)
    outs = [(y, p["key_cache"], p["value_cache"]), (y_ref, *ref_c), w8_chain(p, pw, nkv, vllm_fp8_gemm)]
    errs = chain_errors(p, outs, truth)
    for name, (e_k, e_ref, e_vllm) in errs.items():
        record_property(f"{name}_err", e_k)
        record_property(f"{name}_ref_err", e_ref)
        record_property(f"{name}_vllm_err", e_vllm)
    return errs, dict(zip(("y", "key_cache", "value_cache"), truth, strict=True))


def w8a8_model_errors(p, pw, nkv, y, record_property, ahead=False):
    """{name: (kernel error, model chain error)} against the fp64 truth of the W8A8 builds' own x (x quantized per
    token and 128-group, reference.w8a8_x, dequantized exactly): the arithmetic the build performs, so the kernel
    is held to it as a split-K bf16 kernel is to torch's chain."""
    from musekern.reference import w8a8_gemm, w8a8_x_dequantized

    truth = truth64(dict(p, x=w8a8_x_dequantized(p["x"], ahead)), dequant64(pw), nkv)
    outs = [(y, p["key_cache"], p["value_cache"]), w8_chain(p, pw, nkv, lambda x, w: w8a8_gemm(x, w, ahead))]
    errs = chain_errors(p, outs, truth)
    for name, (e_k, e_m) in errs.items():
        record_property(f"{name}_w8a8_err", e_k)
        record_property(f"{name}_w8a8_model_err", e_m)
    return errs


# the FP8 front builds' M (tiles 1 with its tails, the M == 8 build, tiles 2 with its tails) x each granularity x
# both cache layouts, at the TP8 and TP1 shapes (k_split 2 and 1), padding slots every third token; and TP8's 4-tile
# build (M 17-32: its ends and a tile edge inside)
W8_FRONT_MS = [(tp, m) for tp in (8, 1) for m in (1, 2, 7, 8, 9, 16)] + [(8, m) for m in (17, 24, 25, 32)]


# W8A16 builds ("k"): both bounds. W8A8 builds ("wg"; TP8 M <= 7: x quantized per token and k-tile in the kernel; TP1
# M <= 8: x quantized ahead by x_quant, vLLM's x bytes):
# held to their own arithmetic (reference.w8a8_gemm) as a bf16 kernel is to torch's; their error against vLLM's
# chain is recorded here and bounded over many inputs below (one input's largest error falls either side of vLLM's).
@pytest.mark.parametrize("tp,m", W8_FRONT_MS)
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("mode", ["channel", "block"])
def test_fp8_weight_front(fp8_weights, record_property, tp, layout, mode, m):
    nkv, pw = SHARDS[tp].num_kv_heads, fp8_weights(tp, mode)
    dev = torch.cuda.current_device()
    assert ops._fused(pw.n, m, dev, "fp8_e4m3")
    v = ops._variant(pw.n, m, nkv, dev, "bf16", "fp8_e4m3", mode)
    w8a8 = v.warp_split == "wg"
    record_property("w8a8", w8a8)
    record_property("x_dtype", v.x_dtype)
    p = problem(m, nkv, layout=layout, pad_every=3, seed=900 * tp + m)
    y = run_w8(p, pw, nkv)
    torch.cuda.synchronize()
    errs, _ = w8_errors(p, pw, nkv, y, record_property)
    if w8a8:
        for name, (e_k, e_m) in w8a8_model_errors(p, pw, nkv, y, record_property, v.x_dtype != "bf16").items():
            assert e_k <= 2 * e_m + ATOL, f"{name}: W8A8 error {e_k:.3e} > 2 x its model chain's {e_m:.3e} + {ATOL}"
        return
    for name, (e_k, e_ref, e_vllm) in errs.items():
        assert e_k <= 2 * e_ref + ATOL, f"{name}: kernel error {e_k:.3e} > 2 x the reference's {e_ref:.3e} + {ATOL}"
        assert e_k <= e_vllm + ATOL, f"{name}: kernel error {e_k:.3e} > vLLM's chain {e_vllm:.3e} + {ATOL}"


# W8A8 against vLLM's chain over many inputs: its x groups are finer than vLLM's per-token scale (block weights: the
# same groups), another rounding of x, so one input's largest error falls either side of vLLM's; the mean RMS error
# over 24 inputs may not exceed vLLM's by more than 1% (the model: 0.968x channel, 0.9995x block, the mean of 32
# inputs spreading 0.005; test_reference). TP8 (the builds' shard), M at the tile's ends and inside.
@pytest.mark.parametrize("m", [1, 4, 7])
@pytest.mark.parametrize("mode", ["channel", "block"])
def test_fp8_weight_front_w8a8_error_vs_vllm_on_average(fp8_weights, record_property, mode, m):
    from musekern.reference import vllm_fp8_gemm

    nkv, pw = SHARDS[8].num_kv_heads, fp8_weights(8, mode)
    if ops._variant(pw.n, m, nkv, torch.cuda.current_device(), "bf16", "fp8_e4m3", mode).warp_split != "wg":
        pytest.skip("no W8A8 build planned for TP8 on this GPU")
    sums = {}
    for seed in range(24):
        p = problem(m, nkv, seed=5000 + 31 * m + seed)
        y = run_w8(p, pw, nkv)
        outs = [(y, p["key_cache"], p["value_cache"]), w8_chain(p, pw, nkv, vllm_fp8_gemm)]
        for name, e in chain_errors(p, outs, truth64(p, dequant64(pw), nkv), rms).items():
            sums[name] = [a + b for a, b in zip(sums.get(name, (0.0, 0.0)), e, strict=True)]
    for name, (e_k, e_vllm) in sums.items():
        record_property(f"{name}_rms_ratio", e_k / e_vllm)
        assert e_k <= 1.01 * e_vllm, f"{name}: W8A8 mean RMS error {e_k / 24:.3e} > vLLM's {e_vllm / 24:.3e} x 1.01"


@pytest.mark.parametrize("tp,m,mode", [(8, 1, "channel"), (8, 8, "block"), (8, 16, "block"), (1, 5, "block"),
                                       (1, 9, "channel")])
def test_fp8_weight_front_bitwise_deterministic_20_launches(fp8_weights, tp, m, mode):
    nkv, pw = SHARDS[tp].num_kv_heads, fp8_weights(tp, mode)
    p = problem(m, nkv, seed=13)
    first = run_w8(p, pw, nkv).clone()
    k0 = p["backing"].clone()
    for _ in range(20):
        assert torch.equal(run_w8(p, pw, nkv), first)
        assert torch.equal(p["backing"], k0)


# the GEMM path (every M above the e4m3 front's: 32 at TP8, 16 at TP4): just above the front, a tile-odd M (TP4: the
# block GEMM's M padded to 4), and prefill sizes, at TP8 and TP4, no host sync. Both run vLLM's own arithmetic (x per
# token / per token and 128-group, _scaled_mm row-wise / with 1x128 block scales): the error may differ from the
# exact-sum model of it by a bf16 rounding flip (another summation order), so the bound is vLLM's error plus one bf16
# step of the largest value.
@pytest.mark.parametrize("tp,m", [(8, 33), (8, 64), (8, 100), (8, 1024), (4, 17), (4, 64), (4, 100), (4, 1024)])
@pytest.mark.parametrize("mode", ["channel", "block"])
def test_fp8_weight_gemm_path(fp8_weights, record_property, tp, mode, m):
    nkv, pw = SHARDS[tp].num_kv_heads, fp8_weights(tp, mode)
    assert not ops._fused(pw.n, m, torch.cuda.current_device(), "fp8_e4m3")
    layout = ("vllm", "flashinfer")[m % 2]
    p = problem(m, nkv, num_blocks=max(64, m // 8), layout=layout, pad_every=7, seed=700 * tp + m)
    y = torch.full((m, pw.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_w8(p, pw, nkv, out=y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    errs, truth = w8_errors(p, pw, nkv, y, record_property)
    for name, (e_k, _, e_vllm) in errs.items():
        slack = bf16_step(truth[name].abs().max().item())
        assert e_k <= e_vllm + slack, f"{name}: error {e_k:.3e} > vLLM's chain {e_vllm:.3e} + {slack:.1e}"


@pytest.mark.parametrize("tp,m,mode", [(8, 4, "channel"), (8, 16, "block"), (8, 24, "channel"), (8, 64, "channel"),
                                       (4, 17, "block"), (1, 3, "channel")])
def test_fp8_weight_graph_replay_equals_eager(fp8_weights, tp, m, mode):
    """The front (M <= 16, 32 at TP8) and the GEMM path (above) capture after prepare(weight_format=...) and replay
    bitwise."""
    nkv, pw = SHARDS[tp].num_kv_heads, fp8_weights(tp, mode)
    p = problem(m, nkv, seed=21)
    eager = run_w8(p, pw, nkv).clone()
    ops.prepare(pw.n, [m], num_kv_heads=nkv, weight_format=f"fp8-{mode}")
    assert_graph_replays(lambda out: run_w8(p, pw, nkv, out=out), eager)


# torch's 1x128 block-scaled _scaled_mm (the block path's GEMM above the front) has faulted in CUDA-graph replay with no
# musekern kernel in the graphs (bench/NOTES.md "e4m3 weights": three graphs of it alone in one process, TP8, H100 and
# H200, torch 2.11 + CUDA 13.0). bench/probes/gemm_forms.py repeats that run in a child process (a fault is sticky):
# an xfail where it faults so, a pass where the run replays clean (one run is no proof the fault is gone); any other
# error fails.
def test_block_scaled_mm_graphs_replay():
    from musekern.gemm import fp8 as gemm_fp8

    if gemm_fp8.block_scaled_mm(torch.device("cuda")) is None:
        pytest.skip("torch serves no block-scaled FP8 GEMM here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    ms = "33,36,40,44,48,52,56,60,64,72,96,100,128,256"  # round 82's run (faulted at M = 96)
    probe = os.path.join(root, "bench", "probes", "gemm_forms.py")
    only = ",".join(f"block{p}" for p in (4, 8, 16))
    r = subprocess.run([sys.executable, probe, "--tps", "8", "--ms", ms, "--locate", "--only", only],
                       cwd=root, capture_output=True, text=True, timeout=140, env=dict(os.environ, PYTHONPATH=path))
    if r.returncode and "illegal memory access" in r.stderr:
        pytest.xfail("torch's block-scaled _scaled_mm faulted in graph replay: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-2000:]
