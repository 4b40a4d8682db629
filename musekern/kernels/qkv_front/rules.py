"""The qkv_front planner's rules: which build a call with weight rows N and M tokens takes on a target.

Pure functions of (N, M, num_kv_heads, target): no cutlass, no GPU. Each rule follows H200 measurements
(CUDA graphs over 8 layers of distinct weights; chain = PDL back to back, isolated = no PDL, after-norm = an
RMSNorm before each front); the comment on each cites the `bench/NOTES.md` section with its evidence. These
rules are not part of any cache key: a rule change picks other builds, it never changes what a build is.
"""
from __future__ import annotations

from ...kv_cache import BF16
from ...targets import SMEM_RESERVED_PER_CTA, Target
from .variant import (
    CONSUMER_WARPS,
    FRONT_MAX_TOKENS,
    HEAD_COLS,
    HIDDEN,
    K_TILES,
    MAX_TOKENS,
    MIN_RING_STAGES,
    SPLIT_CHOICES,
    SYNC_TILE_CHOICES,
    TOKEN_TILE,
    QkvFrontVariant,
    owned_tokens,
    ring_smem_bytes,
    stage_bytes,
    supports_shape,
    w_stage_bytes,
)

CTAS_PER_SM = 2  # the shallow ring is sized so that two CTAs share an SM
MIN_CTA_STREAM_BYTES = 512 * 1024  # below this a CTA's fixed costs dominate its stream
SHALLOW_RING_STAGES = 4
MAX_RING_STAGES = 8  # the deep ring with two token tiles
SMEM_RESERVE_BYTES = 24 * 1024  # the deep ring's budget outside the ring (barriers, slots, cos|sin, receive)
WG_FROM_TILES = 3  # builds of this many token tiles and more take wgmma (NOTES "warp_split")
WGMMA_ARCHES = ("sm_90a",)  # wgmma is Hopper's (sm_100a has tcgen05 instead): elsewhere mma.sync, up to 4 tiles
SYNC_MAX_TILES = 4  # without wgmma the front serves up to 4 tiles (above, mma.sync's consumer sets the pace)
UNSPLIT_MAX_TILES = 6  # without a cluster (S = 1: TP2) up to 6 tiles (NOTES "Every M: which path")
WIDE_TILES = 5  # from this many token tiles on, S = 4 where it fits one wave (NOTES "k_split")
# Tile counts the plan takes (a call pads M up to the next one a build of its shape can take): 7 measured faster than
# 8 chained but slower after a norm at TP4 (NOTES "token tiles and fixed_rows"); TP2 does not serve it
PLANNED_TILES = (1, 2, 3, 4, 5, 6, 8)
W8_WIDE_TILES = 4  # e4m3 weights above M = 16: mma.sync builds of up to 4 tiles where their CTAs are alone on their SMs
# (NOTES "e4m3 weights": TP8 M = 17-32 13.9 / 15.0 us against the FP8 GEMM path's 26.7 / 18.8; at TP4, TP1 and 8 tiles
# the GEMM path is as fast or faster)
XMC_FROM_TILES = 8  # wgmma builds with a cluster multicast x between the heads of a pair from 8 tiles on, or from
XMC_WIDE_TILES = 6  # 6 with S = 4 (NOTES "x_mcast")


# NOTES "token tiles and fixed_rows": one build per planned 8-token tile count (M padded up to whole tiles), M == 8 its
# own static-M build; M pads further where the shape has no build of that tile count (`has_tiles_build`).
def token_tiles(m: int, n: int, target: Target, weight_dtype: str = "bf16") -> int:
    """8-token MMA tiles the build for M tokens and weight rows N computes on `target`: the fewest of
    PLANNED_TILES that hold M and that the shape has a build of."""
    if not 1 <= m <= FRONT_MAX_TOKENS:
        raise ValueError(f"M must be in 1..{FRONT_MAX_TOKENS}, got {m}")
    need = (m + TOKEN_TILE - 1) // TOKEN_TILE
    for t in PLANNED_TILES:
        if t >= need and has_tiles_build(n, target, t, weight_dtype):
            return t
    raise ValueError(f"no qkv_front build holds M = {m} on {target.name} (without wgmma the front stops at "
                     f"{SYNC_MAX_TILES * TOKEN_TILE} tokens)")


def has_tiles_build(n: int, target: Target, tiles: int, weight_dtype: str = "bf16") -> bool:
    """Does the plan have a build of this many token tiles for weight rows N on `target`? mma.sync (no wgmma, below
    WG_FROM_TILES, or an e4m3 weight) 1, 2 or 4 (its x ldmatrix takes 8 too, but its consumer sets the pace above 4);
    wgmma any; an owner's tokens (TT / S) must split evenly among the four consumer warps, so S = 4 (TP8 from
    WIDE_TILES) takes even counts only."""
    s = k_split(n, target, tiles)
    if (warp_split(n, s, target, tiles, weight_dtype) != "wg"
            and (tiles not in SYNC_TILE_CHOICES or tiles > SYNC_MAX_TILES)):
        return False
    return owned_tokens(tiles, s) % CONSUMER_WARPS == 0


def fixed_rows(m: int) -> int:
    """M == 8 (one full tile, the most common speculative-decode width) gets its own build."""
    return TOKEN_TILE if m == TOKEN_TILE else 0


def cta_stream_bytes(split: int) -> int:
    """Bytes of W one CTA streams: its head's 64 rows, 1/S of K."""
    return HEAD_COLS * HIDDEN * 2 // split


# NOTES "k_split": the largest S with >= 512 KiB of W per CTA whose heads * S CTAs fit one wave at two per SM; from
# WIDE_TILES token tiles on, S = 4 where its CTAs still fit that wave (each CTA's x re-read then weighs as much as its
# W: every SM streams, not every other one).
def k_split(n: int, target: Target, tiles: int = 1) -> int:
    """Cluster size S: the largest power of two with >= 512 KiB of W per CTA whose heads * S CTAs
    fit in one wave at two CTAs per SM (S = 4 from WIDE_TILES token tiles where those CTAs fit it)."""
    heads = n // HEAD_COLS
    best = 1
    for s in SPLIT_CHOICES:
        big_enough = cta_stream_bytes(s) >= MIN_CTA_STREAM_BYTES or tiles >= WIDE_TILES
        if s <= target.max_cluster and big_enough and heads * s <= CTAS_PER_SM * target.sm_count:
            best = s
    return best


def one_wave_at_two_per_sm(n: int, split: int, target: Target) -> bool:
    return (n // HEAD_COLS) * split <= CTAS_PER_SM * target.sm_count


def alone_on_sm(n: int, split: int, target: Target) -> bool:
    """heads * S CTAs fit one per SM (TP8 on the H200): the SMs they leave free take the next grid's CTAs."""
    return (n // HEAD_COLS) * split <= target.sm_count


# NOTES "ring_stages": shallow (two CTAs per SM, one wave) where the grid fits; the deepest such ring where a
# CTA is alone on its SM; else as deep as one CTA per SM allows (one tile) or MAX_RING_STAGES (two tiles).
# e4m3 weights (issue 30, to be measured): the same W bytes in flight, so twice the stages of half the size; the W8A8
# ("wg") build the same ring as its W8A16 twin (its x slots make it one CTA an SM; 10 stages measured faster than 7, 5).
def ring_stages(split: int, target: Target, tiles: int = 2, n: int | None = None, recv_in_ring: bool = False,
                weight_dtype: str = "bf16", weight_scale: str = "none", x_dtype: str | None = None) -> int:
    """Ring depth (never changes the result). Without `n` (the seed's signature) the deep rule applies. `x_dtype`:
    a W8A8 build's x (its slots hold all of the CTA's k-tiles, beside the ring)."""
    per_cta_tiles = (K_TILES + split - 1) // split
    per_bf16 = max(1, w_stage_bytes() // w_stage_bytes(weight_dtype))
    if n is not None and one_wave_at_two_per_sm(n, split, target):
        top = per_bf16 * (MAX_RING_STAGES if alone_on_sm(n, split, target) else SHALLOW_RING_STAGES)
        for st in range(top, MIN_RING_STAGES - 1, -1):
            fits = ring_smem_bytes(st, tiles, split, recv_in_ring, weight_dtype, weight_scale) + SMEM_RESERVED_PER_CTA
            if CTAS_PER_SM * fits <= target.smem_per_sm:
                return min(st, per_cta_tiles)
    fit = (target.max_smem_optin - SMEM_RESERVE_BYTES) // stage_bytes(tiles, weight_dtype)
    cap = fit if tiles == 1 else per_bf16 * MAX_RING_STAGES
    st = max(MIN_RING_STAGES, min(cap, fit, per_cta_tiles))
    while st > MIN_RING_STAGES and ring_smem_bytes(st, tiles, split, False, weight_dtype, weight_scale,
                                                   "wg" if x_dtype else "k", x_dtype or "bf16") > target.max_smem_optin:
        st -= 1  # 8 tiles: more than SMEM_RESERVE_BYTES outside the ring (receive buffer, cos|sin rows)
    return st


# NOTES "pdl_trigger and trigger_ahead": "early" with the deep ring; with the shallow ring "late", except
# "exit" where the grid doubles CTAs up on SMs with clusters or two token tiles.
def pdl_trigger(n: int, split: int, target: Target, tiles: int = 1) -> str:
    """Where the front lets its dependents launch."""
    if not one_wave_at_two_per_sm(n, split, target):
        return "early"
    doubled = not alone_on_sm(n, split, target)
    return "exit" if doubled and (split > 1 or tiles > 1) else "late"


# NOTES "pdl_trigger and trigger_ahead": one ring turn before the last load where the CTAs are alone on their
# SMs; at the last load where SMs hold two CTAs of one grid.
def trigger_ahead(n: int, split: int, target: Target, tiles: int, stages: int) -> int:
    """k-tiles before the last load where "late" fires."""
    if pdl_trigger(n, split, target, tiles) != "late" or not alone_on_sm(n, split, target):
        return 0
    return stages


# NOTES "warp_split": "k" everywhere except one bf16 token tile under the late trigger; wgmma ("wg") above two tiles,
# where mma.sync's consumer cannot keep up with the stream (not for an e4m3 weight: wgmma has no e4m3 x bf16 form).
# NOTES "e4m3 weights": an e4m3 weight's one-tile runtime-M build is W8A8 through wgmma ("wg") where wgmma is: with
# x quantized in the kernel where its CTAs are alone on their SMs (TP8: M = 1-7, 0.60 / 0.61 of the bf16 front
# chained / after a norm against W8A16's 0.73 / 0.66), reading x quantized ahead by x_quant (`x_dtype` fp8_e4m3) on
# the deep-ring shards (TP1: M = 1-8, 0.572-0.579 against 0.581-0.599; its x in the kernel would leave 11 stages);
# elsewhere, and TP8's M == 8 build (as fast either way), W8A16 under "k". (x quantized ahead at TP8, one and two
# tiles: 0.73-0.76, the grid between two fronts is ~2.5 us there.)
def warp_split(n: int, split: int, target: Target, tiles: int, weight_dtype: str = "bf16", fixed: int = 0) -> str:
    """How the consumer warps share a k-tile (`fixed`: the build's static M, 0 for a runtime M)."""
    if weight_dtype != "bf16":
        return "wg" if w8a8_x(n, split, target, tiles, fixed) else "k"
    if tiles >= WG_FROM_TILES and target.arch in WGMMA_ARCHES:
        return "wg"
    late_one = tiles == 1 and pdl_trigger(n, split, target, tiles) == "late"
    return "rows" if late_one else "k"


def w8a8_x(n: int, split: int, target: Target, tiles: int, fixed: int = 0) -> str | None:
    """The x an e4m3 weight's build reads where it is W8A8 (bf16: quantized in the kernel; fp8_e4m3: ahead, by
    x_quant), None where it is W8A16 (the note above warp_split)."""
    if tiles != 1 or target.arch not in WGMMA_ARCHES:
        return None
    if alone_on_sm(n, split, target):
        return None if fixed else "bf16"
    return None if one_wave_at_two_per_sm(n, split, target) else "fp8_e4m3"


def variant(n: int, m: int, num_kv_heads: int, target: Target, kv_cache_dtype: str = BF16,
            weight_dtype: str = "bf16", weight_scale: str = "none") -> QkvFrontVariant:
    """The compiled variant a call with weight rows N and M tokens takes on `target`, writing caches of
    `kv_cache_dtype` (the same build otherwise: the FP8 store measures no rule of its own), streaming a weight of
    `weight_dtype` with `weight_scale` multipliers (e4m3: the M `front_serves` gives it)."""
    if not supports_shape(n, num_kv_heads):
        raise ValueError(f"qkv_front does not support N={n} with num_kv_heads={num_kv_heads}")
    if weight_dtype != "bf16" and not front_serves(n, m, target, weight_dtype):
        raise ValueError(f"no {weight_dtype} front build serves N = {n}, M = {m} on {target.name} (the FP8 GEMM path "
                         f"does)")
    tiles = token_tiles(m, n, target, weight_dtype)
    s = k_split(n, target, tiles)
    split = warp_split(n, s, target, tiles, weight_dtype, fixed_rows(m))
    x8 = w8a8_x(n, s, target, tiles) if weight_dtype != "bf16" and split == "wg" else None  # W8A8's x
    xd = x8 or "bf16"
    fixed = 0 if xd != "bf16" else fixed_rows(m)  # x quantized ahead: one runtime-M build
    rir = recv_in_ring(n, s, target, tiles, split, weight_dtype)
    stages = ring_stages(s, target, tiles, n, recv_in_ring=rir, weight_dtype=weight_dtype, weight_scale=weight_scale,
                         x_dtype=x8)
    return QkvFrontVariant(n, num_kv_heads, tiles, stages, s, fixed, pdl_trigger(n, s, target, tiles),
                           warp_split=split, trigger_ahead=trigger_ahead(n, s, target, tiles, stages),
                           recv_in_ring=rir, x_mcast=x_mcast(s, tiles, split), kv_cache_dtype=kv_cache_dtype,
                           weight_dtype=weight_dtype, weight_scale=weight_scale, x_dtype=xd)


# NOTES "x_mcast": the heads of a pair share each x tile (half the x reads from the L2) where x weighs most: 8 tiles
# with a cluster (TP8 -2.5%, TP4 -0.5-1%), 6 tiles at S = 4 (TP8 -1%); slower with 4 tiles, at TP4 with 6, at TP2.
def x_mcast(split: int, tiles: int, warp: str) -> bool:
    """Does the build multicast x between the two heads of a pair?"""
    if warp != "wg" or split < 2 or tiles % 2:  # (a pair splits each x tile in whole 8-row tiles)
        return False
    return tiles >= XMC_FROM_TILES or (tiles >= XMC_WIDE_TILES and split >= 4)


# NOTES "ring_stages": a wgmma build keeps its receive buffer in the ring where that buys a third ring stage at two CTAs
# per SM (8 tiles at TP8 and TP4); elsewhere the cluster barrier it needs costs more than it gives (a fourth stage at 5
# tiles too).
def recv_in_ring(n: int, split: int, target: Target, tiles: int, warp: str, weight_dtype: str = "bf16") -> bool:
    """Does the owner's receive buffer live in the (then idle) ring? (Not in an e4m3 one: its wgmma build's x slots
    fill the shared memory.)"""
    if weight_dtype != "bf16":
        return False
    plain = ring_stages(split, target, tiles, n)
    return warp == "wg" and plain == MIN_RING_STAGES and ring_stages(split, target, tiles, n, True) > plain


# NOTES "Every M: which path": the front where it measured faster than its alternative, cuBLAS's GEMM + the fused
# epilogue, else that: above M = 16 where the grid is one wave at two CTAs per SM (TP8, TP4; TP2 up to 48 tokens), not
# where CTAs run in waves (TP1).
# e4m3 weights: the mma.sync builds only (wgmma has no e4m3 x bf16 form), up to W8_WIDE_TILES where those CTAs are
# alone on their SMs (TP8); the FP8 GEMM path above.
def front_serves(n: int, m: int, target: Target, weight_dtype: str = "bf16") -> bool:
    """Does the fused front take a call with weight rows N and M tokens on `target` (pure)?"""
    if not 1 <= m <= FRONT_MAX_TOKENS:
        return False
    if m <= MAX_TOKENS:
        return True
    if weight_dtype != "bf16":
        return m <= W8_WIDE_TILES * TOKEN_TILE and alone_on_sm(n, k_split(n, target, W8_WIDE_TILES), target)
    if m > SYNC_MAX_TILES * TOKEN_TILE and target.arch not in WGMMA_ARCHES:
        return False  # no wgmma: mma.sync builds stop at 4 tiles
    tiles = token_tiles(m, n, target)
    s = k_split(n, target, tiles)
    # above 6 tiles without a cluster (TP2): one CTA owns all its head's tokens, and cuBLAS's M > 48 kernel wins
    return one_wave_at_two_per_sm(n, s, target) and (s > 1 or tiles <= UNSPLIT_MAX_TILES)


def served_tokens(n: int, num_kv_heads: int, target: Target, max_tokens: int = MAX_TOKENS,
                  kv_cache_dtype: str = BF16, weight_dtype: str = "bf16", weight_scale: str = "none") -> dict:
    """{variant: the M values (ascending) that take it} for the calls M = 1..max_tokens the front serves, the
    variants in the order of their first M."""
    out = {}
    for m in range(1, min(max_tokens, FRONT_MAX_TOKENS) + 1):
        if front_serves(n, m, target, weight_dtype):
            v = variant(n, m, num_kv_heads, target, kv_cache_dtype, weight_dtype, weight_scale)
            out.setdefault(v, []).append(m)
    return out


def qkv_front_variants(n: int, num_kv_heads: int, target: Target, max_tokens: int = MAX_TOKENS,
                       kv_cache_dtype: str = BF16, weight_dtype: str = "bf16", weight_scale: str = "none"):
    """Every distinct variant the calls M = 1..max_tokens take where the front serves them, in a stable order."""
    return tuple(served_tokens(n, num_kv_heads, target, max_tokens, kv_cache_dtype, weight_dtype, weight_scale))
