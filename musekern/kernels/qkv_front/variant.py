"""qkv_front, the fused Muse Spark decode attention front (seed 000): what the kernel compiles from.

Shape constants, the variant (`QkvFrontVariant`, validated) and the launch geometry, pure Python (no
cutlass, no GPU). The kernel (kernel.py) imports them, so the planner, the op and
the kernel cannot disagree on a tile size or a shared-memory budget; this file's bytes are part of the
kernel's cache key (`sources`), the planning rules are not (rules.py).

Structure: S = `k_split` CTAs per 64-column head, one cluster (with `x_mcast`, the 2 S CTAs of a head pair);
CTA r of a head streams the k-tiles r, r+S, r+2S, ... (K_TILE columns of K each, head h starting h tiles further
on, cyclically; both heads of a pair from the pair's first) of its head's 64 weight rows through a ring of
`stages` shared-memory stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...kv_cache import BF16, KV_CACHE_DTYPES
from ...model import FRONT_MAX_TOKENS, HEAD_DIM, HIDDEN, supports_shape
from ..base import VariantMixin

HEAD_COLS = HEAD_DIM  # output columns per head = rows of W per cluster
TOKEN_TILE = 8  # tokens per MMA N-tile (mma.sync m16n8k16 / wgmma m64nNk16: W rows are M, tokens are N)
MAX_TOKENS = 16  # the decode builds (1-2 tiles, every shard); above it the front serves where the rules say, up to
# FRONT_MAX_TOKENS (rules.front_serves), else cuBLAS + the fused epilogue
TILE_CHOICES = tuple(range(1, FRONT_MAX_TOKENS // TOKEN_TILE + 1))  # 8-token tiles a build may have (the rules plan
# rules.PLANNED_TILES: M is padded up to the next one the shape has a build of)
SYNC_TILE_CHOICES = (1, 2, 4, 8)  # the tiles an mma.sync build ("rows", "k") takes: its x ldmatrix is x2 or x4
K_TILE = 128  # K columns per ring stage: two 64-wide 128B-swizzled TMA boxes
K_TILES = HIDDEN // K_TILE
W_STAGE_BYTES = HEAD_COLS * K_TILE * 2  # 16 KiB of bf16 weights per stage (8 KiB of e4m3: `w_stage_bytes`)
X_TILE_STAGE_BYTES = TOKEN_TILE * K_TILE * 2  # 2 KiB of bf16 activations per token tile per stage
MIN_RING_STAGES = 2
SPLIT_CHOICES = (1, 2, 4)  # power-of-two clusters that are co-resident (k_split picks 1 or 2; 4 from 5 tiles, even)
# Where the front lets the next grid (PDL) launch: "early" right after init (its W prefill overlaps this whole
# grid), "late" once this CTA's producer has issued its last load (trigger_ahead k-tiles before it, if > 0),
# "exit" never explicitly (a CTA counts as triggered when it exits).
PDL_TRIGGERS = ("early", "late", "exit")
# How the consumer warps share a k-tile: "rows" = warp w owns W rows 16w..16w+15 over all 128 k columns (every
# warp re-reads the whole x stage from shared memory); "k" = warp w owns k columns 32w..32w+31 over all 64
# rows (x read once per stage, a fixed-order 4-way reduction in shared memory after the last k-tile); "wg" = the four
# warps are one warpgroup issuing wgmma m64nTTk16 from the ring (W as A, x as B, both K-major in the ring's 128B
# swizzle): the whole k-tile in one accumulator, no reduction.
WARP_SPLITS = ("rows", "k", "wg")
# The weight the build streams (`weight_dtype`): bf16, or e4m3 (FP8 checkpoints, musekern/weights/pack.py's canonical
# layout) dequantized exactly to bf16 in registers for the bf16 MMA (W8A16: x stays bf16, no activation rounding).
# `weight_scale` says how the fp32 dequant multipliers apply: "channel" one per row (per-tensor checkpoints pack to
# it), applied to the fp32 partials; "block" one per (head, k-tile) = (64 rows, 128 K columns), applied to each
# k-tile's fp32 sum before it joins the accumulator.
WEIGHT_DTYPES = ("bf16", "fp8_e4m3")
WEIGHT_SCALES = {"bf16": ("none",), "fp8_e4m3": ("channel", "block")}
# The x a W8A8 build reads (`x_dtype`) and the token tiles its x slots (all of the CTA's k-tiles) leave room for
X8_MAX_TILES = {"bf16": 1, "fp8_e4m3": 2}


@dataclass(frozen=True)
class QkvFrontVariant(VariantMixin):
    """One compiled qkv_front: serves every layer whose weight has N rows, every M with `tiles` tiles."""
    kernel: ClassVar[str] = "qkv_front"
    sources: ClassVar[tuple[str, ...]] = ("variant.py", "abi.py", "kernel.py", "ring.py", "mma.py", "octets.py",
                                          "fp8.py", "w8.py", "ptx.py", "../../kv_cache.py")
    n: int  # rows of the weight = output columns (q|k|v|gate)
    num_kv_heads: int
    tiles: int  # 8-token tiles (TILE_CHOICES)
    stages: int  # ring depth; never changes the result
    k_split: int  # S, CTAs per cluster splitting K
    fixed_rows: int  # 8 for the M == 8 specialisation, else 0 (M is a runtime parameter)
    trigger: str = "early"  # PDL_TRIGGERS; never changes a bit
    # WARP_SPLITS: changes the summation order (fixed: still bitwise reproducible, independent of stages and
    # trigger)
    warp_split: str = "rows"
    # trigger "late" only: fire once the producer has issued the load of k-tile ntiles - 1 - trigger_ahead
    # instead of the last one (0). Past the ring prefill the next grid still cannot pass its own trigger before
    # this one completes: at most two grids resident. Never changes a bit.
    trigger_ahead: int = 0
    # warp_split "wg" only: the owner's receive buffer for the S partials lives in the ring (idle once every CTA of
    # the cluster has passed its last k-tile: a cluster barrier before the sends), which leaves its shared memory to
    # ring stages. Never changes a bit.
    recv_in_ring: bool = False
    # Heads in pairs (a cluster of 2 S CTAs): the two CTAs of a pair with the same k-split rank read the same x
    # tiles, each loads half of every x tile's rows and multicasts it into both rings (half the x reads from the
    # L2); a stage is refilled once both heads released it. Both heads start at the pair's first k-tile, so the odd
    # head's summation order differs from the unpaired build (still fixed).
    x_mcast: bool = False
    # The KV cache the build writes (kv_cache.KV_CACHE_DTYPES): "bf16", or "fp8_e4m3" (e4m3 bytes of k_bf16 / k_scale,
    # v_bf16 / v_scale; four more launch values: the scales' addresses and values). Never changes y.
    kv_cache_dtype: str = BF16
    # WEIGHT_DTYPES / WEIGHT_SCALES: the weight's bytes and its dequant multipliers (one more launch value, in the bf16
    # builds' unread weight_ptr slot). Changes y (an e4m3 weight is another weight); the e4m3 builds are mma.sync ones.
    weight_dtype: str = "bf16"
    weight_scale: str = "none"
    # X_DTYPES, e4m3 weights' wgmma builds (W8A8) only: "bf16" x quantized in the kernel (per token and k-tile), or
    # "fp8_e4m3" x quantized ahead by x_quant (group 128: vLLM's bytes and scales, [M, 64] column-major; one more
    # launch value) and read as it is: no quantizer in the kernel, x's slots half the bytes (up to 2 token tiles).
    x_dtype: str = "bf16"

    def __post_init__(self):
        problems = []
        if self.weight_dtype not in WEIGHT_DTYPES:
            problems.append(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        elif self.weight_scale not in WEIGHT_SCALES[self.weight_dtype]:
            problems.append(f"weight_scale of a {self.weight_dtype} weight must be one of "
                            f"{WEIGHT_SCALES[self.weight_dtype]}, got {self.weight_scale!r}")
        elif self.weight_dtype != "bf16" and self.warp_split == "wg" and (
                self.tiles > X8_MAX_TILES.get(self.x_dtype, 1) or self.recv_in_ring or self.x_mcast):
            problems.append(f"an e4m3 weight's wgmma build (W8A8) with {self.x_dtype} x holds at most "
                            f"{X8_MAX_TILES.get(self.x_dtype, 1)} token tiles, its x in its own slots: "
                            "no recv_in_ring, no x_mcast")
        if self.x_dtype not in X8_MAX_TILES:
            problems.append(f"x_dtype must be one of {tuple(X8_MAX_TILES)}, got {self.x_dtype!r}")
        elif self.x_dtype != "bf16" and (self.weight_dtype == "bf16" or self.warp_split != "wg"):
            problems.append("x_dtype fp8_e4m3 (x quantized ahead) is an e4m3 weight's wgmma build's (W8A8)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not supports_shape(self.n, self.num_kv_heads):
            problems.append(f"N={self.n} with num_kv_heads={self.num_kv_heads} is not a q|k|v|gate layout")
        if self.tiles not in TILE_CHOICES:
            problems.append(f"tiles must be one of {TILE_CHOICES}, got {self.tiles}")
        elif self.tiles not in SYNC_TILE_CHOICES and self.warp_split != "wg":
            problems.append(f"{self.tiles} tiles need warp_split 'wg' (mma.sync's ldmatrix takes "
                            f"{SYNC_TILE_CHOICES} tiles), got {self.warp_split!r}")
        elif self.k_split in SPLIT_CHOICES and owned_tokens(self.tiles, self.k_split) % CONSUMER_WARPS:
            problems.append(f"{self.tiles} tiles at k_split={self.k_split} give an owner "
                            f"{owned_tokens(self.tiles, self.k_split)} tokens: the epilogue needs a multiple of "
                            f"{CONSUMER_WARPS} (one share per consumer warp)")
        if self.fixed_rows not in (0, TOKEN_TILE) or (self.fixed_rows and self.tiles != 1):
            problems.append(f"fixed_rows must be 0, or {TOKEN_TILE} with tiles=1, got {self.fixed_rows}")
        if self.k_split not in SPLIT_CHOICES:
            problems.append(f"k_split must be one of {SPLIT_CHOICES}, got {self.k_split}")
        elif not MIN_RING_STAGES <= self.stages <= K_TILES // self.k_split:
            problems.append(f"stages must be in {MIN_RING_STAGES}..{K_TILES // self.k_split} for k_split="
                            f"{self.k_split}, got {self.stages}")
        if self.trigger not in PDL_TRIGGERS:
            problems.append(f"trigger must be one of {PDL_TRIGGERS}, got {self.trigger!r}")
        if self.warp_split not in WARP_SPLITS:
            problems.append(f"warp_split must be one of {WARP_SPLITS}, got {self.warp_split!r}")
        elif (self.warp_split == "k" and self.k_split in SPLIT_CHOICES
              and red_bytes(self.tiles) > self.stages * w_stage_bytes(self.weight_dtype)):
            problems.append(f"warp_split 'k' with {self.tiles} tiles sums its partials in the W ring: needs "
                            f">= {-(-red_bytes(self.tiles) // w_stage_bytes(self.weight_dtype))} stages, got "
                            f"{self.stages}")
        if self.recv_in_ring and self.warp_split != "wg":
            problems.append(f"recv_in_ring needs warp_split 'wg', got {self.warp_split!r}")
        # (a q|k|v|gate layout has an even number of heads, and 2 x S <= 8 is a portable cluster)
        if self.x_mcast and self.tiles % 2:
            problems.append(f"x_mcast k_split each x tile's rows between two CTAs in whole 8-row token tiles: "
                            f"needs an even number of tiles, got {self.tiles}")
        if problems:
            raise ValueError(f"invalid qkv_front variant: {'; '.join(problems)}")
        last = K_TILES // self.k_split - 1
        if self.trigger_ahead and not (self.trigger == "late" and 0 < self.trigger_ahead <= last - self.stages):
            raise ValueError(f"qkv_front trigger_ahead needs trigger='late' and 0..{last - self.stages} k-tiles "
                             f"(past the ring prefill), got trigger_ahead={self.trigger_ahead} with "
                             f"trigger={self.trigger!r}")

    @property
    def heads(self) -> int:
        return self.n // HEAD_COLS

    @property
    def num_q_heads(self) -> int:
        return (self.heads - 2 * self.num_kv_heads) // 2


# ---------------------------------------------------------------- launch geometry
# Used by the kernel (which asserts its CuTe smem struct against `smem_bytes`), the planner and the op (grid
# per call) without importing cutlass.
PRODUCER_WARPS = 1
CONSUMER_WARPS = 4  # 4 x 16 W rows = the head's 64 output columns (one m16 MMA tile per warp)
AUX_WARPS = 1
THREADS = 32 * (CONSUMER_WARPS + PRODUCER_WARPS + AUX_WARPS)  # 192: warps 0-3 MMA, 4 TMA, 5 aux
MAX_OWNED_TOKENS = FRONT_MAX_TOKENS  # the most tokens one owner CTA holds (TT / S)
# warp_split="k": each consumer warp takes WARP_K of a k-tile's K_TILE columns (two k16 MMA steps) and
# leaves its 64 x TT fp32 partial in the (then idle) W ring, rows padded to RED_STRIDE words so the
# MMA fragment stores hit distinct banks, for the fixed-order 4-way sum.
WARP_K = K_TILE // CONSUMER_WARPS
RED_STRIDE = HEAD_COLS + 4


def red_bytes(tiles: int) -> int:
    """warp_split "k": the 4 warps' partials, in the W ring after the last k-tile."""
    return CONSUMER_WARPS * tiles * TOKEN_TILE * RED_STRIDE * 4


assert red_bytes(2) <= MIN_RING_STAGES * W_STAGE_BYTES  # one or two tiles fit any bf16 ring


def w_stage_bytes(weight_dtype: str = "bf16") -> int:
    """Bytes of W one ring stage holds: 64 rows x 128 k of bf16 (16 KiB) or e4m3 (8 KiB)."""
    return W_STAGE_BYTES // (2 if weight_dtype == "fp8_e4m3" else 1)


def launch_grid(v: QkvFrontVariant) -> tuple[int, int, int]:
    """heads * S CTAs along x; consecutive groups of S CTAs form one head, of `cluster_size(v)` one cluster."""
    return (v.heads * v.k_split, 1, 1)


def cluster_size(v: QkvFrontVariant) -> int:
    """CTAs of a cluster: the S of one head, or of a head pair with x_mcast."""
    return v.k_split * (2 if v.x_mcast else 1)


def x_box_rows(v: QkvFrontVariant) -> int:
    """Rows of x one TMA box loads: the padded tokens, or half of them with x_mcast (each CTA of a pair one half)."""
    return padded_tokens(v) // (2 if v.x_mcast else 1)


def padded_tokens(v: QkvFrontVariant) -> int:
    """Tokens the MMA computes (rows of x beyond M are zero-filled by TMA)."""
    return v.tiles * TOKEN_TILE


def owned_tokens(tiles: int, k_split: int) -> int:
    """Tokens one owner CTA runs the epilogue for: token t belongs to rank t % S of the TT padded tokens."""
    return tiles * TOKEN_TILE // k_split


def stage_bytes(tiles: int, weight_dtype: str = "bf16") -> int:
    """Bytes landing in one ring stage: W (`w_stage_bytes`) and the stage's x."""
    return w_stage_bytes(weight_dtype) + tiles * X_TILE_STAGE_BYTES


X8_CHUNK = 8  # W8A8 ("wg" e4m3 builds): k-tiles the aux warp quantizes before it lets the consumers at them
SCALES_SMEM = K_TILES  # block scales: a CTA's k-tiles' multipliers staged in shared memory (fp32, at most 64)


def smem_bytes(v: QkvFrontVariant) -> int:
    """Dynamic shared memory of one CTA; must equal the kernel's `Smem.size_in_bytes()`."""
    return ring_smem_bytes(v.stages, v.tiles, v.k_split, v.recv_in_ring, v.weight_dtype, v.weight_scale,
                           v.warp_split, v.x_dtype)


def x_bytes(x_dtype: str) -> int:
    """Bytes of one x value the build reads."""
    return 1 if x_dtype == "fp8_e4m3" else 2


def ring_smem_bytes(stages: int, tiles: int, k_split: int, recv_in_ring: bool = False,
                    weight_dtype: str = "bf16", weight_scale: str = "none", warp_split: str = "k",
                    x_dtype: str = "bf16") -> int:
    """`smem_bytes` of a variant with this ring depth, tile count, S and receive-buffer place (nothing else changes
    it).

    Layout (the kernel's @cute.struct, in order): W ring (stages x 16 KiB, e4m3 8 KiB, 1024-aligned for the 128B
    swizzle),
    x ring (stages x TT x 256 B, 1024-aligned), full/empty/recv mbarriers (8 B each), a staged
    slot (int64) and cos|sin row (64 fp32) per owned token (TT / S), the owner's receive buffer for the
    S partials (TT x 64 fp32, S x TT/S tokens; none with `recv_in_ring`), block scales (`SCALES_SMEM` fp32); padded to
    the struct's 1024-byte alignment.
    """
    tt = tiles * TOKEN_TILE
    owned = owned_tokens(tiles, k_split)
    ring = stages * (tt * K_TILE * 2 + w_stage_bytes(weight_dtype))
    small = 8 * (2 * stages + 1) + 8 * owned
    small = (small + 15) // 16 * 16 + 4 * owned * 64 + (0 if recv_in_ring else 4 * tt * HEAD_COLS)
    small += 4 * SCALES_SMEM if weight_scale == "block" else 0
    if weight_dtype != "bf16" and warp_split == "wg":  # W8A8: x's slots are the CTA's k-tiles, not the stages
        ntiles = K_TILES // k_split
        ring += ntiles * tt * K_TILE * x_bytes(x_dtype) - stages * tt * K_TILE * 2
        small = (small + 8 * 2 * (ntiles // X8_CHUNK) + 15) // 16 * 16 + 4 * ntiles * tt
    return (ring + small + 1023) // 1024 * 1024
