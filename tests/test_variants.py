import json
import os
import subprocess
import sys

import pytest

from musekern.config import load_config
from musekern.kernels.qk_norm.variant import QkNormVariant, qk_norm_variant, supports_qk_norm
from musekern.kernels.qkv_front.rules import (
    MAX_RING_STAGES,
    SMEM_RESERVE_BYTES,
    fixed_rows,
    front_serves,
    k_split,
    qkv_front_variants,
    ring_stages,
    token_tiles,
    variant,
)
from musekern.kernels.qkv_front.variant import (
    FRONT_MAX_TOKENS,
    K_TILES,
    SPLIT_CHOICES,
    QkvFrontVariant,
    smem_bytes,
    stage_bytes,
    supports_shape,
)
from musekern.plan import plan_model, shard_plan, variant_from_label
from musekern.targets import SMEM_RESERVED_PER_CTA, get_target

H200 = get_target("h200")


# Each side of every tile boundary: the planned tile counts (1-6 and 8: 7 measured slower after a norm) where the
# shape has a build (TP8 from 5 tiles S = 4, even counts only), and without wgmma (sm_100a) mma.sync's 1, 2, 4, up to
# 32 tokens (None: no build holds M).
TILE_EDGES = (1, 7, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57, 64)


@pytest.mark.parametrize("n,target,tiles", [
    (4352, "h200", (1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 8, 8, 8, 8)),
    (8704, "h200", (1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 8, 8, 8, 8)),
    (2176, "h200", (1, 1, 1, 2, 2, 3, 3, 4, 4, 6, 6, 6, 6, 8, 8, 8, 8)),
    (4352, "b200", (1, 1, 1, 2, 2, 4, 4, 4, 4) + (None,) * 8)])
def test_token_tiles_and_fixed_rows(n, target, tiles):
    t = get_target(target)
    for m, want in zip(TILE_EDGES, tiles, strict=True):
        if want is None:
            with pytest.raises(ValueError, match="without wgmma the front stops at 32 tokens"):
                token_tiles(m, n, t)
        else:
            assert token_tiles(m, n, t) == want, m
    assert [fixed_rows(m) for m in TILE_EDGES] == [8 if m == 8 else 0 for m in TILE_EDGES]


# Every target, every shard of the bundled model, every M: where the front serves M the rules give a valid variant
# that holds M, with the planned tile count, that fits the target's shared memory.
@pytest.mark.parametrize("target", ["h200", "h100", "h100-pcie", "h20", "b200"])
@pytest.mark.parametrize("n,nkv", [(2176, 1), (4352, 2), (8704, 4), (17408, 8)])
def test_every_served_m_has_a_valid_build(target, n, nkv):
    t = get_target(target)
    for m in filter(lambda m: front_serves(n, m, t), range(1, FRONT_MAX_TOKENS + 1)):
        v = variant(n, m, nkv, t)
        assert v.tiles == token_tiles(m, n, t) and m <= v.tiles * 8 and smem_bytes(v) <= t.max_smem_optin, m


@pytest.mark.parametrize("m", [0, 65, -1])
def test_token_tiles_range(m):
    with pytest.raises(ValueError, match="1..64"):
        token_tiles(m, 2176, H200)


def test_odd_tiles_need_wgmma_and_whole_shares():
    """The variant itself refuses what `has_tiles_build` skips: an odd tile count under mma.sync, or an owner share
    the four consumer warps cannot split (S = 4 with odd tiles)."""
    base = variant(4352, 24, 2, H200)
    assert (base.tiles, base.warp_split, base.k_split, base.x_mcast) == (3, "wg", 2, False)
    with pytest.raises(ValueError, match="need warp_split 'wg'"):
        QkvFrontVariant(**{**base.__dict__, "warp_split": "k"})
    with pytest.raises(ValueError, match="14 tokens"):
        QkvFrontVariant(**{**base.__dict__, "tiles": 7, "k_split": 4})
    with pytest.raises(ValueError, match="even number of tiles"):
        QkvFrontVariant(**{**base.__dict__, "x_mcast": True})


# The default model's four TP shards on the 132-SM H200 and the 78-SM H20, and a TP16 shard: S is the
# largest power of two with >= 512 KiB of W per CTA (S <= 2) and heads * S <= 2 x SMs (bench/NOTES.md).
@pytest.mark.parametrize("n,target,s", [(2176, "h200", 2), (4352, "h200", 2), (8704, "h200", 1), (17408, "h200", 1),
                                        (2176, "h20", 2), (4352, "h20", 2), (8704, "h20", 1), (1152, "h200", 2)])
def test_k_split(n, target, s):
    assert k_split(n, get_target(target)) == s


# Measured rules: a ring that lets two CTAs share an SM (the deepest that does where a CTA is alone on its
# SM: 6 stages with one token tile, 5 with two; else 4) and a late PDL trigger when the grid then fits in one
# wave; otherwise 8 stages and an early trigger.
# The consumer warps split each k-tile by k columns except for one token tile under the late trigger (TP8 and
# TP2 at M <= 8); the deep ring is 11 stages (all one CTA may have) with one token tile, 8 with two; no explicit
# PDL trigger where the shallow ring doubles CTAs up on SMs with clusters (TP4) or two tiles (TP2 M > 8).
# "late" fires one ring turn before the last load where the grid's CTAs are alone on their SMs (TP8), at the
# last load where SMs hold two (TP2).
# Each row: (M = 1 value, M = 16 value) of stages, trigger, warp split and trigger_ahead.
@pytest.mark.parametrize("n,target,stages,trigger,split,ahead", [
    (2176, "h200", (6, 5), ("late", "late"), ("rows", "k"), (6, 5)),
    (4352, "h200", (4, 4), ("exit", "exit"), ("k", "k"), (0, 0)),
    (8704, "h200", (4, 4), ("late", "exit"), ("rows", "k"), (0, 0)),
    (17408, "h200", (11, 8), ("early", "early"), ("k", "k"), (0, 0)),
    (8704, "h20", (4, 4), ("late", "exit"), ("rows", "k"), (0, 0)),
    (17408, "h20", (11, 8), ("early", "early"), ("k", "k"), (0, 0))])
@pytest.mark.parametrize("m", [1, 16])
def test_planned_ring_trigger_and_warp_split(n, target, stages, trigger, split, ahead, m):
    t = get_target(target)
    v = variant(n, m, {2176: 1, 4352: 2, 8704: 4, 17408: 8}[n], t)
    i = int(m > 8)
    assert (v.stages, v.trigger, v.warp_split, v.trigger_ahead) == (stages[i], trigger[i], split[i], ahead[i])
    if v.stages < 8:  # two CTAs really fit on one SM
        assert 2 * (smem_bytes(v) + SMEM_RESERVED_PER_CTA) <= t.smem_per_sm


def test_ring_stages_fit_shared_memory():
    for split in SPLIT_CHOICES:
        for tiles in (1, 2):
            st = ring_stages(split, H200, tiles)
            assert 2 <= st <= (K_TILES if tiles == 1 else MAX_RING_STAGES)
            assert st * stage_bytes(tiles) + SMEM_RESERVE_BYTES <= H200.max_smem_optin


@pytest.mark.parametrize("n,nkv,ok", [(2176, 1, True), (4352, 2, True), (17408, 8, True), (2176, 2, False),
                                      (2175, 1, False), (64 * 4, 1, True), (64 * 3, 1, False), (0, 1, False),
                                      (2176, 0, False)])
def test_supports_shape(n, nkv, ok):
    assert supports_shape(n, nkv) is ok


def test_variant_one_build_per_tile_count():
    vs = qkv_front_variants(2176, 1, H200)
    assert [(v.tiles, v.fixed_rows) for v in vs] == [(1, 0), (1, 8), (2, 0)]
    assert variant(2176, 3, 1, H200) == variant(2176, 7, 1, H200) == vs[0]
    assert variant(2176, 16, 1, H200) == vs[2]
    with pytest.raises(ValueError, match="does not support"):
        variant(2176, 1, 2, H200)


def test_qk_norm_variants():
    assert supports_qk_norm("bfloat16", 128) and not supports_qk_norm("float32", 128)
    assert not supports_qk_norm("bfloat16", 96)
    assert qk_norm_variant("bfloat16", 64, 1.0) == QkNormVariant("bfloat16", 64, False)
    assert qk_norm_variant("bfloat16", 64, 0.5).has_scale
    with pytest.raises(ValueError, match="does not support"):
        QkNormVariant("bfloat16", 96, False)
    with pytest.raises(ValueError, match="vecs_per_thread"):
        QkNormVariant("bfloat16", 64, False, 2)


# The work split by input size: one vector per thread up to 128 CTAs' worth (32768 16-byte vectors: 64 rows of
# 64 heads of 64), four above; [16, 4096] (the seed's M = 16 shape) is small, M = 4096 is large; without a
# size, the large build.
@pytest.mark.parametrize("hd,m,heads,vpt", [(64, 16, 64, 1), (128, 16, 32, 1), (64, 64, 64, 1), (64, 65, 64, 4),
                                           (64, 4096, 128, 4), (256, 1, 1, 1)])
def test_qk_norm_variant_by_input_size(hd, m, heads, vpt):
    from musekern.kernels.qk_norm.variant import qk_norm_vectors

    assert qk_norm_variant("bfloat16", hd, 1.0, qk_norm_vectors(hd, m, heads)).vecs_per_thread == vpt
    assert qk_norm_variant("bfloat16", hd, 1.0).vecs_per_thread == 4


def test_default_plan():
    entries = plan_model(load_config(), [H200])
    kinds = [(e.kernel, e.variant.params().get("n")) for e in entries]
    assert kinds.count(("qk_norm", None)) == 4  # with / without scale, large / small inputs
    assert kinds.count(("qkv_epilogue", None)) == 3  # one build serves every N: small, large and huge inputs
    # tiles 1 (+ the M == 8 build), 2, and 3, 4, 5, 6, 8 (TP8: no 5; TP2: up to 6; TP1: none)
    for n, builds in ((2176, 7), (4352, 8), (8704, 7), (17408, 3)):
        assert kinds.count(("qkv_front", n)) == builds
    assert len(entries) == 32
    tp_of = {e.variant.n: e.tps for e in entries if e.kernel == "qkv_front"}
    assert tp_of == {17408: (1,), 8704: (2,), 4352: (4,), 2176: (8,)}


def test_labels_round_trip():
    for e in plan_model(load_config(), [H200, get_target("b200")]):
        assert variant_from_label(e.variant.label) == e.variant


@pytest.mark.parametrize("label,msg", [("nope[x=1]", "not a variant label"), ("qk_norm[dtype=bfloat16]", "missing"),
                                       ("qk_norm[dtype=bfloat16,head_dim=x,has_scale=True]", "integer"),
                                       ("qk_norm[dtype=bfloat16,head_dim=64,has_scale=maybe]", "True or False"),
                                       ("qk_norm[dtype=bfloat16,head_dim=64,has_scale=True,zz=1]", "no parameter")])
def test_bad_labels(label, msg):
    with pytest.raises(ValueError, match=msg):
        variant_from_label(label)


def test_shards_partition_the_plan():
    entries = plan_model(load_config(), [H200, get_target("h100-pcie")])
    for n in (1, 2, 3, 5):
        shards = [shard_plan(entries, k, n) for k in range(1, n + 1)]
        flat = [e for s in shards for e in s]
        assert sorted(flat, key=lambda e: e.sort_key()) == sorted(entries, key=lambda e: e.sort_key())
        assert len(flat) == len(set(flat))
    with pytest.raises(ValueError):
        shard_plan(entries, 0, 2)


def test_variant_dataclasses_are_frozen_and_hashable():
    v = QkvFrontVariant(2176, 1, 1, 8, 2, 0)
    with pytest.raises(AttributeError):
        v.n = 1
    assert len({v, QkvFrontVariant(2176, 1, 1, 8, 2, 0)}) == 1


def test_plan_is_deterministic_across_hash_seeds():
    """`musekern plan --json` is byte-identical across runs and PYTHONHASHSEED values."""
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-m", "musekern.cli", "plan", "--target", "h200", "--target", "h20",
                            "--json"], capture_output=True, env=env, check=True)
        outs.add(r.stdout)
    assert len(outs) == 1
    doc = json.loads(outs.pop())
    assert len(doc["variants"]) == 64  # 32 a target (test_default_plan) on h200 and on h20


# From 5 token tiles on (M > 32) S = 4 where heads x 4 CTAs fit one wave at two per SM (TP8 on the H200 and H20),
# else the small-M rule; below 5 tiles never 4 (bench/NOTES.md "k_split").
@pytest.mark.parametrize("n,target,tiles,s", [(2176, "h200", 5, 4), (2176, "h200", 6, 4), (2176, "h200", 8, 4),
                                              (2176, "h200", 3, 2), (2176, "h200", 4, 2), (4352, "h200", 5, 2),
                                              (4352, "h200", 8, 2), (8704, "h200", 8, 1), (2176, "h20", 8, 4),
                                              (4352, "h20", 6, 2)])
def test_k_split_wide(n, target, tiles, s):
    assert k_split(n, get_target(target), tiles) == s


# The receive buffer moves into the ring only where that buys a third ring stage at two CTAs per SM (the 8-tile
# builds of TP8 and TP4); elsewhere its cluster barrier costs more than it gives (TP4 at 5 tiles: a fourth stage)
# (bench/NOTES.md "ring_stages").
@pytest.mark.parametrize("n,nkv,m,rir", [(2176, 1, 16, False), (2176, 1, 24, False), (2176, 1, 32, False),
                                         (2176, 1, 40, False), (2176, 1, 48, False), (2176, 1, 64, True),
                                         (4352, 2, 40, False), (4352, 2, 48, False), (4352, 2, 56, True),
                                         (4352, 2, 64, True)])
def test_recv_in_ring_rule(n, nkv, m, rir):
    from musekern.kernels.qkv_front.rules import ring_stages

    v = variant(n, m, nkv, H200)
    assert v.recv_in_ring == rir
    assert v.stages == ring_stages(v.k_split, H200, v.tiles, n, recv_in_ring=rir)
    plain, in_ring = ring_stages(v.k_split, H200, v.tiles, n), ring_stages(v.k_split, H200, v.tiles, n, True)
    assert rir == (plain == 2 and in_ring > plain)  # (TP4 5 tiles: in_ring 4 > plain 3, not taken)


# x multicast between head pairs: the wgmma builds with a cluster from 8 tiles (TP8, TP4) and from 6 at S = 4 (TP8);
# never one tile or two (mma.sync), 3 to 5 tiles (an odd count cannot split in whole tiles), TP4 at 6, a build
# without a cluster (TP2, TP1), nor on the B200 (no wgmma) (bench/NOTES.md "x_mcast")
@pytest.mark.parametrize("n,nkv,m,target,xmc", [
    (2176, 1, 16, "h200", False), (2176, 1, 24, "h200", False), (2176, 1, 32, "h200", False),
    (2176, 1, 40, "h200", True), (2176, 1, 48, "h200", True), (2176, 1, 56, "h200", True),
    (2176, 1, 64, "h200", True), (4352, 2, 32, "h200", False), (4352, 2, 48, "h200", False),
    (4352, 2, 40, "h200", False), (4352, 2, 56, "h200", True), (4352, 2, 64, "h200", True),
    (8704, 4, 48, "h200", False),
    (8704, 4, 64, "h200", False),
    (17408, 8, 64, "h200", False), (2176, 1, 32, "b200", False)])
def test_x_mcast_rule(n, nkv, m, target, xmc):
    v = variant(n, m, nkv, get_target(target))
    assert v.x_mcast == xmc
    assert not xmc or (v.warp_split == "wg" and v.k_split >= 2 and v.tiles >= 6)


# each field of QkvFrontVariant that __post_init__ guards, with a value outside its domain (the trigger "wait" was a
# lever once: measured slower, removed); 3 and 6 tiles need wgmma, the M = 1 build is mma.sync's "rows"
@pytest.mark.parametrize("field,value,msg", [("warp_split", "cols", "warp_split"), ("trigger", "wait", "trigger"),
                                             ("stages", 33, "stages"), ("stages", 1, "stages"),
                                             ("k_split", 3, "k_split"), ("tiles", 3, "need warp_split 'wg'"),
                                             ("tiles", 6, "need warp_split 'wg'"), ("tiles", 9, "tiles must be one of"),
                                             ("tiles", 0, "tiles must be one of"),
                                             ("fixed_rows", 16, "fixed_rows"), ("n", 2175, "q|k|v|gate"),
                                             ("trigger_ahead", 26, "trigger_ahead"),
                                             ("trigger_ahead", -1, "trigger_ahead"),
                                             ("recv_in_ring", True, "recv_in_ring"), ("x_mcast", True, "x_mcast")])
def test_qkv_front_variant_rejects_out_of_domain_fields(field, value, msg):
    import dataclasses

    v = variant(2176, 1, 1, H200)  # TP8 M=1: "rows", 6 stages, "late" 6 k-tiles ahead (25 at most: 31 - 6)
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(v, **{field: value})


# trigger_ahead applies to the late trigger only, up to the last k-tile past the ring prefill
def test_qkv_front_trigger_ahead_domain():
    import dataclasses

    v = variant(2176, 1, 1, H200)
    assert dataclasses.replace(v, trigger_ahead=25).trigger_ahead == 25  # 31 - 6
    with pytest.raises(ValueError, match="trigger_ahead needs trigger='late'"):
        dataclasses.replace(v, trigger="exit")
    assert dataclasses.replace(v, trigger="exit", trigger_ahead=0).trigger_ahead == 0


# The builds the GPU tests launch beyond the plan (tests/qkv_front_builds.py), for every planned qkv_front: each
# same-bits alternative is legal and differs from the plan in its lever only; the other warp split is legal.
def test_gpu_test_builds_move_one_lever():
    import dataclasses

    from qkv_front_builds import gpu_test_builds, other_warp_split, same_bits_alternatives

    planned = [e.variant for e in plan_model(load_config(), [H200]) if e.kernel == "qkv_front"]
    for v in planned:
        alts = same_bits_alternatives(v)
        assert set(alts) == ({"stages", "trigger"} | ({"trigger_ahead"} if v.trigger == "late" else set())
                             | ({"recv_in_ring"} if v.recv_in_ring else set()))
        for lever, alt in alts.items():
            moved = {f.name for f in dataclasses.fields(v) if getattr(alt, f.name) != getattr(v, f.name)}
            assert lever in moved and moved <= {lever, "trigger_ahead"}, (lever, v.label)
            assert (alt.n, alt.tiles, alt.k_split, alt.warp_split) == (v.n, v.tiles, v.k_split, v.warp_split)
        other = other_warp_split(v)
        assert other is None or other.warp_split != v.warp_split
        assert other is not None or v.warp_split == "wg"  # 3, 5, 6 tiles: wgmma only; 8: "k" needs a deeper ring
    builds = gpu_test_builds(planned)
    assert len(builds) == len(set(builds)) and not set(builds) & set(planned)


# "k" with 4 tiles sums its partials in the W ring (34 KiB: 3 stages of 16 KiB at least); "rows" needs none, and
# one or two tiles' partials fit any ring ("2x2" and 8 tiles were measured and removed: NOTES)
@pytest.mark.parametrize("tiles,split,stages,ok", [(4, "k", 3, True), (4, "k", 2, False), (4, "rows", 2, True),
                                                   (2, "k", 2, True), (4, "2x2", 4, False)])
def test_warp_split_by_tile_count(tiles, split, stages, ok):
    make = lambda: QkvFrontVariant(2176, 1, tiles, stages, 2, 0, "late", warp_split=split)  # noqa: E731
    if ok:
        assert make().warp_split == split
    else:
        with pytest.raises(ValueError, match="warp_split"):
            make()


# Above M = 16 (measured, bench/NOTES.md "Every M: which path"): the front serves M <= 64 where heads x S CTAs fill
# one wave at two per SM (TP8, TP4, TP2 on the H200; wgmma builds of 3 to 8 tiles but 7, TP8 not 5), not where the CTAs
# run in waves (TP1): it takes cuBLAS + the fused epilogue above 16. The M <= 16 builds stay the plan's.
@pytest.mark.parametrize("n,nkv,served,tiles", [(2176, 1, True, [3, 4, 6, 8]), (4352, 2, True, [3, 4, 5, 6, 8]),
                                                (8704, 4, True, [3, 4, 5, 6]), (17408, 8, False, [])])
def test_front_variants_above_16(n, nkv, served, tiles):
    small = qkv_front_variants(n, nkv, H200)
    full = qkv_front_variants(n, nkv, H200, FRONT_MAX_TOKENS)
    assert full[:len(small)] == small
    wide = served and n != 8704  # TP2 (S = 1): above 6 tiles cuBLAS's M > 48 kernel wins
    assert [v.tiles for v in full[len(small):]] == tiles
    for m, t in ((17, 3), (24, 3), (25, 4), (32, 4), (33, 5), (40, 5), (41, 6), (48, 6), (49, 8), (64, 8)):
        if n == 2176 and t == 5:
            t = 6  # S = 4 from 5 tiles: no odd tile count
        v = variant(n, m, nkv, H200)  # a build exists either way (the GPU tests keep it correct)
        on = served and (t <= 6 or wide)
        assert front_serves(n, m, H200) == on and (v in full) == on and v.tiles == t
        assert v.warp_split == "wg"
        assert smem_bytes(v) <= H200.max_smem_optin
    assert all(front_serves(n, m, H200) for m in range(1, 17))
    assert qkv_front_variants(n, nkv, H200, 1000) == full  # nothing past FRONT_MAX_TOKENS
    assert not front_serves(n, FRONT_MAX_TOKENS + 1, H200) and not front_serves(n, 0, H200)


# `prepare --variant` sorts any set of labels: variants whose params leave out different defaults (an int in one
# where the other has a str) still order
def test_plan_entries_of_mixed_fields_sort():
    from musekern.plan import PlanEntry

    a = QkvFrontVariant(2176, 1, 4, 4, 2, 0, "late", warp_split="k", trigger_ahead=4)
    b = QkvFrontVariant(2176, 1, 4, 4, 2, 0, "late", trigger_ahead=4)
    c = QkvFrontVariant(2176, 1, 4, 4, 2, 0, "exit", warp_split="k")
    entries = sorted({PlanEntry(H200, v, ()) for v in (a, b, c)}, key=PlanEntry.sort_key)
    assert len(entries) == 3
