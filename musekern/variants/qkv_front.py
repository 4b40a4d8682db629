"""Planner for qkv_front, the fused Muse Spark decode attention front (seed 000).

Pure functions of (N, M, num_kv_heads, target): no cutlass, no GPU. The kernel
(`musekern/kernels/qkv_front.py`) imports the shape constants below, so the planner and
the kernel cannot disagree on a tile size or a shared-memory budget.

Structure being planned: one cluster of S = k_split CTAs per 64-column head; CTA r of a
cluster streams the k-tiles r, r+S, r+2S, ... (K_TILE columns of K each) of its head's
64 weight rows through a ring of `ring_stages` shared-memory stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..targets import SMEM_RESERVED_PER_CTA, Target
from .base import VariantMixin

HIDDEN = 8192  # K of the projection (Muse Spark hidden size)
HEAD_COLS = 64  # output columns per head = rows of W per cluster
TOKEN_TILE = 8  # tokens per MMA N-tile (mma.sync m16n8k16: W rows are M, tokens are N)
MAX_TOKENS = 16  # 1 <= M <= 16 decode tokens
K_TILE = 128  # K columns per ring stage: two 64-wide 128B-swizzled TMA boxes
K_TILES = HIDDEN // K_TILE
W_STAGE_BYTES = HEAD_COLS * K_TILE * 2  # 16 KiB of bf16 weights per stage
X_TILE_STAGE_BYTES = TOKEN_TILE * K_TILE * 2  # 2 KiB of bf16 activations per token tile per stage
# Shared memory outside the ring: mbarriers, the owner's receive buffer for the S partials
# (fp32, 64 columns x up to 16 tokens per peer), slots, cos|sin rows and the epilogue tile.
SMEM_RESERVE_BYTES = 24 * 1024
MAX_RING_STAGES = 8  # streaming probe: 8 x 16 KiB stages reached 77-78% (TP8, S=2) and 90% (TP4, S=1)
# The deep ring (one CTA per SM, several waves: TP1) with one token tile streams faster the deeper it is, so
# it takes all the shared memory one CTA may have: chain M=1 68.2 / 67.6 / 67.1 / 66.6 us at 8 / 9 / 10 / 11
# stages (h200-sweep-round10.json, -round11.json); with two tiles (the MMA consumer is the limit) 8 stays
# best, 71.4 / 71.6 / 71.9 us at 8 / 9 / 10.
MIN_RING_STAGES = 2
# Streaming probe (H200): clusters of 3 are not all co-resident with one CTA per SM, so S is a power of two.
SPLIT_CHOICES = (1, 2, 4, 8)
PDL_TRIGGERS = ("early", "wait", "late", "exit")
# How the consumer warps share a k-tile (bench/NOTES.md round 8): "rows" = warp w owns W rows
# 16w..16w+15 over all 128 k columns (every warp re-reads the whole x stage from shared memory and runs
# one dependent MMA chain per token tile); "k" = warp w owns k columns 32w..32w+31 over all 64 rows (x
# is read from shared memory once per stage, 4 x tiles independent MMA chains per warp, and a fixed-order
# 4-way reduction in shared memory after the last k-tile).
WARP_SPLITS = ("rows", "k")


@dataclass(frozen=True)
class QkvFrontVariant(VariantMixin):
    """One compiled qkv_front: serves every layer whose weight has N rows, every M with `tiles` tiles."""
    kernel: ClassVar[str] = "qkv_front"
    n: int  # rows of the weight = output columns (q|k|v|gate)
    num_kv_heads: int
    tiles: int  # 8-token tiles (1 or 2)
    stages: int  # ring depth; never changes the result
    splits: int  # S, CTAs per cluster splitting K
    fixed_m: int  # 8 for the M == 8 specialisation, else 0 (M is a runtime parameter)
    # Where the front lets the next grid (PDL) launch: "early" right after init (its W prefetch
    # overlaps this whole grid), "wait" once this CTA's griddepcontrol.wait returned (the previous grid
    # is complete: at most two grids are resident), "late" once this CTA's producer has issued its last load (the
    # next grid lands while this one drains its ring and runs the epilogue), "exit" never explicitly
    # (a CTA counts as triggered when it exits: the next grid lands as this one finishes). Never
    # changes a bit.
    trigger: str = "early"
    # k-tiles of each of the CTA's W rows prefetched into L2 (cp.async.bulk.prefetch.L2) before
    # griddepcontrol.wait, so HBM keeps streaming while the previous grid finishes; 0 = off.
    l2_prefetch: int = 0
    # Head h streams its k-tiles starting h * k_rotate tiles further on (cyclically): spreads the
    # clusters' reads of the shared x over the L2 instead of every cluster reading the same x tile
    # at once. Changes the summation order (fixed per head: still bitwise reproducible). 0 = off.
    k_rotate: int = 0
    # WARP_SPLITS: which part of each k-tile a consumer warp computes. Changes the summation order
    # (fixed: still bitwise reproducible, and independent of stages and trigger).
    warp_split: str = "rows"
    # trigger "late" only: let the next grid launch once the producer has issued the load of k-tile
    # ntiles - 1 - trigger_ahead instead of the last one (0). Any point past the ring prefill still keeps
    # at most two grids resident: the next grid cannot pass its own trigger before this one completes.
    # Never changes a bit.
    trigger_ahead: int = 0
    # warp_split "rows" only: k-tiles 0..stash-1 whose W the consumer warps take into registers before x
    # exists (before griddepcontrol.wait), freeing their ring slots so the producer streams `stash` more
    # k-tiles of W before the wait; their x lands in its own shared-memory area after the wait. The MMAs
    # run in the same order: never changes a bit. <= stages; 32 registers per consumer thread a k-tile.
    stash: int = 0

    def __post_init__(self):
        problems = []
        if not supports_shape(self.n, self.num_kv_heads):
            problems.append(f"N={self.n} with num_kv_heads={self.num_kv_heads} is not a q|k|v|gate layout")
        if self.tiles not in (1, MAX_TOKENS // TOKEN_TILE):
            problems.append(f"tiles must be 1 or {MAX_TOKENS // TOKEN_TILE}, got {self.tiles}")
        if self.fixed_m not in (0, TOKEN_TILE) or (self.fixed_m and self.tiles != 1):
            problems.append(f"fixed_m must be 0, or {TOKEN_TILE} with tiles=1, got {self.fixed_m}")
        if self.splits not in SPLIT_CHOICES:
            problems.append(f"splits must be one of {SPLIT_CHOICES}, got {self.splits}")
        elif not MIN_RING_STAGES <= self.stages <= K_TILES // self.splits:
            problems.append(f"stages must be in {MIN_RING_STAGES}..{K_TILES // self.splits} for splits="
                            f"{self.splits}, got {self.stages}")
        if problems:
            raise ValueError(f"invalid qkv_front variant: {'; '.join(problems)}")
        if self.trigger not in PDL_TRIGGERS:
            raise ValueError(f"qkv_front trigger must be one of {PDL_TRIGGERS}, got {self.trigger!r}")
        if self.warp_split not in WARP_SPLITS:
            raise ValueError(f"qkv_front warp_split must be one of {WARP_SPLITS}, got {self.warp_split!r}")
        if self.k_rotate < 0:
            raise ValueError(f"qkv_front k_rotate must be >= 0, got {self.k_rotate}")
        if not 0 <= self.l2_prefetch <= K_TILES:
            raise ValueError(f"qkv_front l2_prefetch must be in 0..{K_TILES} k-tiles, got {self.l2_prefetch}")
        if self.stash and not (self.warp_split == "rows" and 0 < self.stash <= self.stages):
            raise ValueError(f"qkv_front stash needs warp_split='rows' and 0..stages ({self.stages}) k-tiles, "
                             f"got stash={self.stash} with warp_split={self.warp_split!r}")
        last = K_TILES // self.splits - 1
        if self.trigger_ahead and not (self.trigger == "late"
                                       and 0 < self.trigger_ahead <= last - self.stages - self.stash):
            raise ValueError(f"qkv_front trigger_ahead needs trigger='late' and 0..{last - self.stages - self.stash}"
                             f" k-tiles (past the prefill of stages + stash), got trigger_ahead="
                             f"{self.trigger_ahead} with trigger={self.trigger!r}")

    @property
    def heads(self) -> int:
        return self.n // HEAD_COLS

    @property
    def num_q_heads(self) -> int:
        return (self.heads - 2 * self.num_kv_heads) // 2


def token_tiles(m: int) -> int:
    """8-token MMA tiles needed for M tokens."""
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"M must be in 1..{MAX_TOKENS}, got {m}")
    return (m + TOKEN_TILE - 1) // TOKEN_TILE


def fixed_rows(m: int) -> int:
    """M == 8 (one full tile, the most common speculative-decode width) gets its own build."""
    return TOKEN_TILE if m == TOKEN_TILE else 0


def supports_shape(n: int, num_kv_heads: int) -> bool:
    """Can qkv_front serve a weight of N rows with these KV heads (q|k|v|gate, 64 columns a head)?"""
    if n <= 0 or n % HEAD_COLS or num_kv_heads < 1:
        return False
    rest = n // HEAD_COLS - 2 * num_kv_heads  # q + gate heads
    return rest >= 2 and rest % 2 == 0 and (rest // 2) % num_kv_heads == 0


# ---------------------------------------------------------------- the planner's rules, from measurements
# bench/results/h200-sweep-stages-splits.json and h200-sweep-trigger-stages.json (H200, CUDA graphs of 8
# layers over distinct weights; chain = PDL back to back, isolated = no PDL), summarised in bench/NOTES.md:
# - a ring small enough for TWO CTAs per SM (4 stages) wins whenever heads * S CTAs then fit in one wave:
#   TP2 36 us isolated / 35 us chain vs 45 / 42 us with 8 stages (136 CTAs > 132 SMs: 2 waves);
# - with two CTAs per SM the front must let its dependents launch LATE (after its last load): an early
#   trigger puts the next grid's CTAs on the SMs while this grid streams (TP2 chain 52.6 us early vs
#   34.8 us late); with one CTA per SM (deep ring) early is as good or better (TP1 71.2 vs 73.1 us);
# - splitting K so far that a CTA streams < 512 KiB of W loses to fixed per-CTA costs (TP8: S=4 13.8 us
#   vs S=2 11.6 us chain at M=1);
# - TP1 (272 CTAs > 2 x 132): no single wave either way; the deep ring is faster (71.2 vs 75.2 us chain).
# - with no explicit trigger ("exit": the next grid launches as this one's CTAs exit) TP4's chain equals its
#   isolated launches, 19.6 / 21.4 us at M=1 / 16, where "late" made it slower (20.5 / 21.9); at TP2 and TP8
#   "late" stays better (34.5 vs 35.2, 11.4 vs 12.2 us; h200-sweep-round11.json).
# - under "exit", "k" is as fast or faster than "rows" where CTAs double up (TP4 chain 19.3 / 20.6 vs 19.4 / 21.2
#   us at M=1 / 16), and TP2's two-tile build is fastest with "k" and "exit" (36.6 us; "rows" + "late" 37.3,
#   "k" + "late" 38.3; h200-sweep-round13.json). L2 prefetch and a trigger right after the wait ("wait") were
#   slower at TP8 and TP4 in every combination (h200-sweep-round12.json).
# - rotating each head's k-tile order by one tile per head (k_rotate=1) is 0-4% faster than lockstep
#   (TP4 chain 20.0 vs 20.8 us, TP1 69.5 vs 70.1; h200-sweep-k-rotate.json); an L2 prefetch of the W
#   rows before griddepcontrol.wait is slower at every depth (TP8 12.7-16.4 vs 12.0 us,
#   h200-sweep-l2-prefetch.json), so it stays off.
# - warp_split "k" (each consumer warp owns 32 k columns of a stage, x read once per CTA) against "rows"
#   (h200-sweep-warp-split.json, chain M=1 / 8 / 16 us): TP1 68.2 / 68.6 / 70.9 vs 70.7 / 70.9 / 79.8 and TP8
#   11.2 / 12.0 / 11.3 vs 11.2 / 11.3 / 13.3 (a CTA alone on its SM: the consumer was the M=16 bottleneck);
#   where the grid doubles CTAs up on SMs with the shallow ring, "rows" stays as fast or faster in the chain:
#   TP2 34.3 / 35.0 / 37.2 vs 34.9 / 36.0 / 38.6, TP4 20.4 / 21.1 / 21.8 vs 20.5 / 21.3 / 22.0. At TP8 with one
#   token tile the chain with "k" is bimodal (10.8-13.9 us over graph sizes and repeats, 12.4-13.1 in the
#   bench) where "rows" stays at 10.9-11.5 (h200-sweep-round9.json, h200-sweep-graph-size.json); with two
#   token tiles "k" wins there too (TP8 M=16: 11.2 vs 13.2 us). Together with round 13 (below the "exit"
#   entry): "k" everywhere except one token tile under the late trigger.
# - where "late" fires (h200-sweep-round16.json, --repeat 2, chain / after-norm total us per layer, M = 1 / 8 /
#   16): at TP8 one ring turn before the last load (trigger_ahead = stages = 5) 10.48 / 10.51 / 10.54 and
#   12.99 / 13.11 / 13.23 against 10.86 / 11.09 / 10.97 and 13.95 / 14.00 / 14.21 at the last load; 4 tiles
#   ahead is 0.1-0.2 us faster in the chain but slower and unsteady after the norm (12.5-13.4), 6 ahead the
#   reverse (chain 10.8-11.0). At TP2 (SMs hold two CTAs of one grid) 4 tiles ahead is much slower (38.7 vs
#   33.9). The skeleton probe put the optimum at 4-6 too (h200-skeleton-probe-ahead-r*.json). A stash of W in
#   registers before x exists (the probe's best: 8.8 us) gains nothing measurable in the front at trigger_ahead 5
#   (10.42-10.54 with 2 or 4 k-tiles) and slows the isolated launch 0.1-0.3 us: planned off. With the 6-stage
#   one-tile ring (round 17, --repeat 3) trigger_ahead 4 / 5 / 6: chain 10.07 / 10.14 / 10.45 us, after-norm
#   total 13.96 (bimodal) / 12.65 / 11.29 at M = 1: ahead = stages stays the steady choice.
# - TP4 / TP2 with a 3-stage ring (three CTAs per SM where registers allow, so the next grid can land whole):
#   "late" with or without trigger_ahead 2.7-8 us slower than the plan, "exit" 0.6 us slower
#   (h200-sweep-round18.json): the plan keeps 4 stages there.
# - TP8 with the deep ring (one CTA per SM, 11 stages) and the trigger 5-6 k-tiles ahead: chain 9.15-9.38 us
#   (90-91% of copy bandwidth), but after the norm 12.0-13.0 us added (vs 11.3) and isolated 12.5-12.8 (vs
#   12.0-12.2); no trigger point of the deep ring is good in both PDL modes (h200-sweep-round19b.json). A decode
#   step runs the front after a norm, never back to back: the plan keeps the shared 6-stage ring.
#   Rounds 21-26 (bench/NOTES.md): after the norm the next front lands two launches after the trigger, ~1.3 us
#   later than in a chain, and a prefill still landing at the previous grid's end delays the norm 1:1; the deep
#   ring's best trigger there is 11 ahead (10.25-10.61 us added, chain 11.6-11.9). A stash (11.0-11.7 chain,
#   h200-sweep-round23.json) or loading part of the ring after the wait (13.5-14.5, h200-sweep-round26.json) makes
#   no trigger point good in both modes either.
# - TP4 at k_split 1 with the deep ring (68 CTAs, TP8's shape): chain 23.7-26.5 vs 19.1-20.2 us: the 4 CTAs
#   that find no free SM carry a whole head (1 MiB) from the previous grid's end (h200-sweep-round25.json).
CTAS_PER_SM = 2
MIN_CTA_STREAM_BYTES = 512 * 1024
SHALLOW_RING_STAGES = 4
K_ROTATE = 1


def cta_stream_bytes(split: int) -> int:
    """Bytes of W one CTA streams: its head's 64 rows, 1/S of K."""
    return HEAD_COLS * HIDDEN * 2 // split


def k_split(n: int, target: Target) -> int:
    """Cluster size S: the largest power of two with >= 512 KiB of W per CTA whose heads * S CTAs
    fit in one wave at two CTAs per SM (measured: see the rules above)."""
    heads = n // HEAD_COLS
    best = 1
    for s in SPLIT_CHOICES:
        if (s <= target.max_cluster and cta_stream_bytes(s) >= MIN_CTA_STREAM_BYTES
                and heads * s <= CTAS_PER_SM * target.sm_count):
            best = s
    return best


def one_wave_at_two_per_sm(n: int, split: int, target: Target) -> bool:
    return (n // HEAD_COLS) * split <= CTAS_PER_SM * target.sm_count


def alone_on_sm(n: int, split: int, target: Target) -> bool:
    """heads * S CTAs fit one per SM (TP8 on the H200): the SMs they leave free take the next grid's CTAs."""
    return (n // HEAD_COLS) * split <= target.sm_count


def stage_bytes(tiles: int) -> int:
    return W_STAGE_BYTES + tiles * X_TILE_STAGE_BYTES


def ring_stages(split: int, target: Target, tiles: int = 2, n: int | None = None) -> int:
    """Ring depth. Shallow (two CTAs per SM) when the grid then fits in one wave, else as deep as one
    CTA per SM allows (one tile) or that capped at MAX_RING_STAGES (two tiles); never deeper than a
    CTA's k-tiles.

    The result does not depend on it (the GPU tests compare two depths bit for bit). Without `n`
    (the seed's signature) the deep rule applies.
    """
    per_cta_tiles = (K_TILES + split - 1) // split
    if n is not None and one_wave_at_two_per_sm(n, split, target):
        # A CTA alone on its SM (heads * S <= SMs, TP8) takes the deepest ring that still lets the
        # next grid's CTA share the SM: 5 stages, 11.4 vs 12.0 us chain at M=1 (4 vs 5); with the smem
        # outside the ring sized by owned tokens, 6 with one tile: chain 10.07-10.45 vs 10.42-10.63 us at
        # trigger_ahead 4-6 (h200-sweep-ring5.json, h200-sweep-round17.json: 5 stages cannot keep enough
        # bytes in flight, h200-tail-trace.json); where SMs hold two CTAs (TP4, TP2) 4 stages is as
        # fast or faster.
        top = MAX_RING_STAGES if alone_on_sm(n, split, target) else SHALLOW_RING_STAGES
        for st in range(top, MIN_RING_STAGES - 1, -1):
            if CTAS_PER_SM * (ring_smem_bytes(st, tiles, split) + SMEM_RESERVED_PER_CTA) <= target.smem_per_sm:
                return min(st, per_cta_tiles)
    fit = (target.max_smem_optin - SMEM_RESERVE_BYTES) // stage_bytes(tiles)
    cap = fit if tiles == 1 else MAX_RING_STAGES
    return max(MIN_RING_STAGES, min(cap, fit, per_cta_tiles))


def pdl_trigger(n: int, split: int, target: Target, tiles: int = 1) -> str:
    """Where the front lets its dependents launch (measured, see above): 'early' with the deep ring (one CTA
    per SM over several waves); with the shallow ring 'late', except 'exit' (no explicit trigger) where the
    grid doubles CTAs up on SMs (heads * S > SMs) with clusters (TP4) or with two token tiles (TP2 M > 8):
    there any overlap with the next grid measured slower than none."""
    if not one_wave_at_two_per_sm(n, split, target):
        return "early"
    doubled = not alone_on_sm(n, split, target)
    return "exit" if doubled and (split > 1 or tiles > 1) else "late"


def trigger_ahead(n: int, split: int, target: Target, tiles: int, stages: int) -> int:
    """k-tiles before the last load where "late" fires: one ring turn (`stages`) where this grid's CTAs are
    alone on their SMs (heads * S <= SMs: TP8), so the next grid's launch and prefill overlap this grid's
    last loads on the free SMs; 0 (the last load) where SMs hold two CTAs of one grid. Measured, above."""
    if pdl_trigger(n, split, target, tiles) != "late" or not alone_on_sm(n, split, target):
        return 0
    return stages


def warp_split(n: int, split: int, target: Target, tiles: int) -> str:
    """'k' everywhere except one token tile under the 'late' trigger (TP8 and TP2 at M <= 8), where "rows"
    is as fast and steadier in the chain: a "k" CTA drains its ring sooner after its last load, so more of
    the next grid's prefill lands on its tail (bimodal 10.8-13.9 us at TP8). Measured, above."""
    return "rows" if tiles == 1 and pdl_trigger(n, split, target, tiles) == "late" else "k"


def variant(n: int, m: int, num_kv_heads: int, target: Target) -> QkvFrontVariant:
    """The compiled variant a call with weight rows N and M tokens takes on `target`."""
    if not supports_shape(n, num_kv_heads):
        raise ValueError(f"qkv_front does not support N={n} with num_kv_heads={num_kv_heads}")
    tiles = token_tiles(m)
    s = k_split(n, target)
    stages = ring_stages(s, target, tiles, n)
    return QkvFrontVariant(n, num_kv_heads, tiles, stages, s, fixed_rows(m), pdl_trigger(n, s, target, tiles),
                           k_rotate=K_ROTATE, warp_split=warp_split(n, s, target, tiles),
                           trigger_ahead=trigger_ahead(n, s, target, tiles, stages))


def qkv_front_variants(n: int, num_kv_heads: int, target: Target, max_tokens: int = MAX_TOKENS):
    """Every distinct variant the calls M = 1..max_tokens take, in a stable order."""
    seen = []
    for m in range(1, max_tokens + 1):
        v = variant(n, m, num_kv_heads, target)
        if v not in seen:
            seen.append(v)
    return tuple(seen)


# ---------------------------------------------------------------- launch geometry (pure helpers)
# Used by the kernel (musekern/kernels/qkv_front.py, which asserts its CuTe smem struct against
# `smem_bytes`) and by the op (grid per call) without importing cutlass.
PRODUCER_WARPS = 1
CONSUMER_WARPS = 4  # 4 x 16 W rows = the head's 64 output columns (one m16 MMA tile per warp)
AUX_WARPS = 1
THREADS = 32 * (CONSUMER_WARPS + PRODUCER_WARPS + AUX_WARPS)  # 192: warps 0-3 MMA, 4 TMA, 5 aux
MAX_OWNED_TOKENS = MAX_TOKENS  # the most tokens one owner CTA holds (TT / S)
# warp_split="k": each consumer warp takes WARP_K of a k-tile's K_TILE columns (two k16 MMA steps) and
# leaves its 64 x TT fp32 partial in the (then idle) W ring, rows padded to RED_STRIDE words so the
# MMA fragment stores hit distinct banks, for the fixed-order 4-way sum.
WARP_K = K_TILE // CONSUMER_WARPS
RED_STRIDE = HEAD_COLS + 4
assert CONSUMER_WARPS * MAX_TOKENS * RED_STRIDE * 4 <= MIN_RING_STAGES * W_STAGE_BYTES


def launch_grid(v: QkvFrontVariant) -> tuple[int, int, int]:
    """heads * S CTAs along x; consecutive groups of S CTAs form one cluster (one head)."""
    return (v.heads * v.splits, 1, 1)


def padded_tokens(v: QkvFrontVariant) -> int:
    """Tokens the MMA computes (rows of x beyond M are zero-filled by TMA)."""
    return v.tiles * TOKEN_TILE


def smem_bytes(v: QkvFrontVariant) -> int:
    """Dynamic shared memory of one CTA; must equal the kernel's `Smem.size_in_bytes()`.

    Layout (the kernel's @cute.struct, in order): W ring (stages x 16 KiB, 1024-aligned for the
    128B swizzle), x ring (stages x TT x 256 B, 1024-aligned), with a stash the stashed k-tiles' x
    (stash x TT x 256 B, 1024-aligned), full/empty/recv (and stashed-x) mbarriers (8 B each), a staged
    slot (int64) and cos|sin row (64 fp32) per owned token (TT / S), the owner's receive
    buffer for the S partials (TT x 64 fp32, S x TT/S tokens).
    """
    return ring_smem_bytes(v.stages, v.tiles, v.splits, v.stash)


def owned_tokens(tiles: int, splits: int) -> int:
    """Tokens one owner CTA runs the epilogue for: token t belongs to rank t % S of the TT padded tokens."""
    return tiles * TOKEN_TILE // splits


def ring_smem_bytes(stages: int, tiles: int, splits: int, stash: int = 0) -> int:
    """`smem_bytes` of a variant with this ring depth, tile count, S and stash (nothing else changes it)."""
    tt = tiles * TOKEN_TILE
    owned = owned_tokens(tiles, splits)
    ring = (stages + stash) * tt * K_TILE * 2 + stages * W_STAGE_BYTES  # a stashed k-tile keeps only its x
    small = 8 * (2 * stages + 1 + (1 if stash else 0)) + 8 * owned
    small = (small + 15) // 16 * 16 + 4 * owned * 64 + 4 * tt * HEAD_COLS
    total = ring + small
    return (total + 1023) // 1024 * 1024  # the struct is padded to its 1024-byte alignment


# ---------------------------------------------------------------- builds that must give the same bits
# The contract: ring depth, PDL trigger (and trigger_ahead), L2 prefetch and the stash never change a bit.
# The GPU tests (tests/test_gpu_qkv_front.py) compare these builds with the planned ones bit for bit;
# bench/gpu_cache.sh builds them.
ALT_STAGES = 3
ALT_PREFETCH = 32  # k-tiles per row
ALT_STASH = 2
ALT_TRIGGER_AHEAD = 4


def same_bits_alternatives(v: QkvFrontVariant) -> dict[str, QkvFrontVariant]:
    """Per lever, a build of `v` with that lever moved (stash and trigger_ahead only where they apply)."""
    from dataclasses import replace

    stages = ALT_STAGES if v.stages != ALT_STAGES else ALT_STAGES + 1
    alts = {"stages": replace(v, stages=stages, stash=min(v.stash, stages)),
            "trigger": replace(v, trigger="late" if v.trigger == "early" else "early", trigger_ahead=0),
            "l2_prefetch": replace(v, l2_prefetch=ALT_PREFETCH if v.l2_prefetch == 0 else 0)}
    if v.warp_split == "rows":
        alts["stash"] = replace(v, stash=0 if v.stash else min(ALT_STASH, v.stages))
    if v.trigger == "late":
        alts["trigger_ahead"] = replace(v, trigger_ahead=0 if v.trigger_ahead else ALT_TRIGGER_AHEAD)
    return alts


def other_warp_split(v: QkvFrontVariant) -> QkvFrontVariant:
    """`v` with the other warp split (a different, fixed summation order); "k" takes no stash."""
    from dataclasses import replace

    return replace(v, warp_split="k", stash=0) if v.warp_split == "rows" else replace(v, warp_split="rows")
