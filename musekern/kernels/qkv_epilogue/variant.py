"""Planner for qkv_epilogue: the fused epilogue of the attention front for a GEMM done elsewhere (cuBLAS).

y = bf16(x @ W^T) [M, N] (q | k | v | gate, 64 columns a head) is given; the kernel RMS-norms and RoPEs the q
and k heads in place and writes k and v to the paged caches (musekern.reference.fused_qknorm_rope_kv_insert).
Pure: no cutlass, no GPU, no torch. The kernel (kernel.py) imports the constants below.

One build serves every N and head layout (nq, nkv and the row stride are runtime parameters); the variant is
only how many 16-byte vectors each thread carries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...kv_cache import BF16, KV_CACHE_DTYPES
from ...model import HEAD_DIM, supports_shape
from ..base import VariantMixin

# Launch geometry (single source of truth; kernel.py and abi.py import it). The kernel touches the q, k and v
# heads of every row (H = nq + 2 nkv heads; the gate heads are neither read nor written), each as EPI_LANES
# 16-byte vectors. A thread is one unit (row r, lane j, head group g): vector j of heads g * vpt .. g * vpt + vpt - 1
# of row r (vpt = vecs_per_thread), so its vectors share one position, one slot and one cos|sin piece. A row is
# row_units = EPI_LANES * ceil(H / vpt) units, flattened row-major with j fastest: the 8 lanes of one (row, head
# group) are 8 consecutive, 8-aligned lanes that reduce each head's sum of squares with butterfly shuffles, and one
# warp load reads 512 bytes of y: contiguous with vpt = 1, else 4 whole 128-byte heads vpt heads apart. In an FP8
# build a warp is one head group of four rows (j fastest, then the row), so the k/v groups' e4m3 stores (fp8.py) run
# in warps of their own rather than holding up three q groups (TP8: 1.32 -> 1.19x the bf16 time at M = 1024,
# bench/NOTES.md "FP8 KV cache"); the warps of four rows take the row's head groups in turn (the group fastest), so
# those heavier warps spread over every CTA, and the last M % 4 rows form one block of fewer rows. Unit w of the
# M * row_units is thread w % EPI_BLOCK of CTA (w % G) // EPI_BLOCK in round w // G, G = grid * EPI_BLOCK.
EPI_HEAD_DIM = HEAD_DIM  # columns per head (Muse Spark); 32 RoPE pairs
EPI_VEC_ELEMS = 8  # bf16 elements per 16-byte vector: 4 RoPE pairs
EPI_LANES = EPI_HEAD_DIM // EPI_VEC_ELEMS  # lanes (vectors) per head
EPI_BLOCK = 256  # threads per CTA (compiled with .reqntid; an FP8 build with .maxntid and .minnctapersm)
# Vectors (heads) per thread: all its y loads are issued before any is used, so a thread has 16 B x vpt of y in
# flight; the cos|sin, position and slot loads are shared by its heads.
EPI_VPT_CHOICES = (1, 2, 4, 8)
# Rounds: a thread works on `rounds` units in turn, each the grid's thread count after the last. Before the first it
# prefetches the later rounds' y vectors, positions and slots to the L2 (prefetch.global.L2: no register holds them),
# so their DRAM latency passes during the earlier rounds' work.
EPI_ROUNDS_CHOICES = (1, 2)  # 4 rounds of two vectors measured slower than 2 everywhere (NOTES "qkv_epilogue")
# CTAs (of EPI_BLOCK threads) of each build (vecs_per_thread, rounds) an SM holds: ptxas gives them 32 / 48 / 79 / 127
# registers a thread with one round, 48 / 63 / 114 / 165 with two (tests/test_kernels_qkv_epilogue.py checks the
# bound; capping them with .minnctapersm spills and measured slower: bench/NOTES.md, "Levers measured and dropped"),
# so with one round an SM has 32 / 40 / 48 / 64 KiB of y loads in flight (2048 / 1280 / 768 / 512 threads x 16 B x
# vecs_per_thread).
EPI_CTAS_PER_SM = {(1, 1): 8, (2, 1): 5, (4, 1): 3, (8, 1): 2, (1, 2): 5, (2, 2): 4, (4, 2): 2, (8, 2): 1}
# The FP8-cache builds (kv_cache_dtype "fp8_e4m3") are compiled with .minnctapersm of the same count (ptxas left
# alone gives (2, 1) 57 registers and (2, 2) 69: 4 and 3 CTAs an SM, and with PDL two launches of 288 CTAs, TP8 M =
# 1024, no longer fit the GPU together); bounded, they take 32 / 48 / 80 / 126 and 48 / 63 / 113 / 165 registers with
# no local memory and no stack (tests/test_kernels_qkv_epilogue.py)
# The rule (measured, bench/NOTES.md "qkv_epilogue"), by the 16-byte vectors of the input (M * H * 8):
#   <= EPI_SMALL_VECTORS: one vector, one round: as fast as any on small inputs and up to 0.16 us faster on some
#   (TP4 M <= 64), where a call costs 1.2-1.3 us;
#   <= EPI_ROUNDS_VECTORS: two vectors, one round: the fastest (or within 2%) at M = 1024 and 4096 of every shard but
#   TP1's 4096;
#   above: two vectors, two rounds (the second round's y prefetched to the L2): 2-6% ahead of one round from
#   2.4M vectors (TP8 M = 16384) up, 5-11% behind it at 0.6-1.2M, 22-32% at 0.15-0.3M.
EPI_SMALL = (1, 1)
EPI_LARGE = (2, 1)
EPI_HUGE = (2, 2)
EPI_SMALL_VECTORS = 128 * EPI_BLOCK
EPI_ROUNDS_VECTORS = 1 << 21
# The flattened unit index is an Int32 in the kernel (the last CTA's dead lanes of the last round run up to
# EPI_BLOCK * max rounds - 1 past it).
EPI_MAX_UNITS = 2**31 - 1 - EPI_BLOCK * max(EPI_ROUNDS_CHOICES)
EPI_GRID_RULE = (f"grid = (ceil(M * {EPI_LANES} * ceil((nq + 2 * nkv) / vecs_per_thread) / ({EPI_BLOCK} * rounds)), "
                 f"1, 1); block = ({EPI_BLOCK}, 1, 1); M == 0 launches nothing")


@dataclass(frozen=True)
class QkvEpilogueVariant(VariantMixin):
    """One compiled qkv_epilogue: serves every N, head layout, row stride, cache layout and M."""
    kernel: ClassVar[str] = "qkv_epilogue"
    # (its FP8 store is qkv_front's fp8.py)
    sources: ClassVar[tuple[str, ...]] = ("variant.py", "abi.py", "kernel.py", "../qkv_front/fp8.py",
                                          "../qkv_front/ptx.py", "../../kv_cache.py")
    vecs_per_thread: int  # EPI_VPT_CHOICES; never changes a bit
    rounds: int = 1  # EPI_ROUNDS_CHOICES; never changes a bit
    kv_cache_dtype: str = BF16  # the KV cache it writes (kv_cache.KV_CACHE_DTYPES); never changes y

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"qkv_epilogue kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.vecs_per_thread not in EPI_VPT_CHOICES:
            raise ValueError(f"qkv_epilogue vecs_per_thread must be one of {EPI_VPT_CHOICES}, "
                             f"got {self.vecs_per_thread!r}")
        if self.rounds not in EPI_ROUNDS_CHOICES:
            raise ValueError(f"qkv_epilogue rounds must be one of {EPI_ROUNDS_CHOICES}, got {self.rounds!r}")

    @property
    def ctas_per_sm(self) -> int:
        """CTAs of this build one SM holds (register bound)."""
        return EPI_CTAS_PER_SM[(self.vecs_per_thread, self.rounds)]


def all_builds(kv_cache_dtype: str = BF16) -> tuple[QkvEpilogueVariant, ...]:
    """Every build the GPU tests, the sanitizer, bench/epilogue_cache.sh and the bench's sweep take: each
    vecs_per_thread with each rounds (writing caches of `kv_cache_dtype`)."""
    return tuple(QkvEpilogueVariant(v, r, kv_cache_dtype) for v in EPI_VPT_CHOICES for r in EPI_ROUNDS_CHOICES)


def head_counts(n: int, num_kv_heads: int) -> tuple[int, int]:
    """(nq, nkv) of a q | k | v | gate row of N columns; ValueError where N is not such a layout."""
    if not supports_shape(n, num_kv_heads):
        raise ValueError(f"N={n} is not a q|k|v|gate layout of {EPI_HEAD_DIM}-column heads with "
                         f"num_kv_heads={num_kv_heads}")
    return (n // EPI_HEAD_DIM - 2 * num_kv_heads) // 2, num_kv_heads


def epilogue_vectors(m: int, n: int, num_kv_heads: int) -> int:
    """16-byte vectors of y the kernel reads for M tokens: the q, k and v heads of every row."""
    nq, nkv = head_counts(n, num_kv_heads)
    return int(m) * (nq + 2 * nkv) * EPI_LANES


def row_units(v: QkvEpilogueVariant, n: int, num_kv_heads: int) -> int:
    """Threads per row of y: EPI_LANES per group of vecs_per_thread heads (the last group may be partial)."""
    nq, nkv = head_counts(n, num_kv_heads)
    return EPI_LANES * -(-(nq + 2 * nkv) // v.vecs_per_thread)


def max_rows(v: QkvEpilogueVariant, n: int, num_kv_heads: int) -> int:
    """The largest M one launch of `v` takes (the kernel's Int32 unit index)."""
    return EPI_MAX_UNITS // row_units(v, n, num_kv_heads)


# (the build, its inclusive upper bound in vectors) in rule order: the first tier whose bound the input fits
_TIERS = ((EPI_SMALL, EPI_SMALL_VECTORS), (EPI_LARGE, EPI_ROUNDS_VECTORS), (EPI_HUGE, None))


def epilogue_variant(n: int, m: int, num_kv_heads: int, kv_cache_dtype: str = BF16) -> QkvEpilogueVariant:
    """The build a call with N columns and M tokens takes (the rule above), writing caches of `kv_cache_dtype`."""
    vectors = epilogue_vectors(m, n, num_kv_heads)
    build = next(b for b, bound in _TIERS if bound is None or vectors <= bound)  # the last tier has no bound
    return QkvEpilogueVariant(*build, kv_cache_dtype)


def rows_served(v: QkvEpilogueVariant, n: int, num_kv_heads: int) -> tuple[int, int] | None:
    """(first, last) M that the rule sends to `v` for this N (last: one launch's limit), or None."""
    per_row = epilogue_vectors(1, n, num_kv_heads)
    first = 1
    for build, bound in _TIERS:
        last = max_rows(v, n, num_kv_heads) if bound is None else min(bound // per_row, max_rows(v, n, num_kv_heads))
        if (v.vecs_per_thread, v.rounds) == build:
            return (first, last) if first <= last else None
        first = last + 1
    return None


def qkv_epilogue_variants(kv_cache_dtype: str = BF16) -> tuple[QkvEpilogueVariant, ...]:
    """Every build the rule picks (the same for every shard), largest inputs first."""
    return tuple(QkvEpilogueVariant(*build, kv_cache_dtype) for build, _ in reversed(_TIERS))


def launch_grid(v: QkvEpilogueVariant, m: int, n: int, num_kv_heads: int) -> tuple[int, int, int]:
    """The grid of a launch (the kernel's own host code uses the same rule). (0, 1, 1) when M == 0: the caller
    must then skip the launch. Depends on M and N only, never on data (CUDA-graph safe)."""
    m = int(m)
    if m < 0:
        raise ValueError(f"qkv_epilogue: M={m} must be >= 0")
    total = m * row_units(v, n, num_kv_heads)
    if total > EPI_MAX_UNITS:
        raise ValueError(f"qkv_epilogue: M={m} rows of N={n} are {total} units of {v.label}; at most "
                         f"{EPI_MAX_UNITS} (M <= {max_rows(v, n, num_kv_heads)}) per launch (Int32 index)")
    per_cta = EPI_BLOCK * v.rounds
    return ((total + per_cta - 1) // per_cta, 1, 1)


# ---------------------------------------------------------------- bytes the kernel must move
POS_SLOT_BYTES = 16  # int64 position + int64 slot per token
COS_SIN_ROW_BYTES = 2 * (EPI_HEAD_DIM // 2) * 4  # float32 cos | sin row per token (read once per token at best)


def epilogue_bytes(m: int, n: int, num_kv_heads: int, written_slots: int | None = None) -> int:
    """The fewest bytes of device memory one launch moves (each input read once, each output written once):
    per token, the q and k heads of y read and written back, the v heads read, k and v written to the caches
    (tokens with a valid slot: `written_slots`, default all M), its position, slot and cos|sin row."""
    nq, nkv = head_counts(n, num_kv_heads)
    head = EPI_HEAD_DIM * 2
    w = m if written_slots is None else written_slots
    return m * ((nq + nkv) * 2 * head + nkv * head + POS_SLOT_BYTES + COS_SIN_ROW_BYTES) + w * 2 * nkv * head
