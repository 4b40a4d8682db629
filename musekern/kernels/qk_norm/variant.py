"""Planner for qk_norm: unweighted RMS norm per head_dim group (seed 002)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import VariantMixin

SUPPORTED_DTYPES = ("bfloat16", "float16")
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # one row of 16-byte vectors per warp slice; see kernel.py

# Launch geometry of the qk_norm kernel (kernel.py and abi.py import these: single source of truth).
# The [M, heads*head_dim] input is seen as M*heads*head_dim/VEC_ELEMS 16-byte vectors, flattened
# row-major; thread t of CTA b handles vectors b*TILE + u*BLOCK + t for u < vecs_per_thread (TILE =
# BLOCK * vecs_per_thread), and the head_dim/VEC_ELEMS consecutive lanes that share one (row, head)
# reduce with butterfly shuffles.
QK_NORM_VEC_ELEMS = 8  # 16 bytes of bf16/fp16 per load and store
QK_NORM_BLOCK = 256  # threads per CTA (the kernel is compiled with .reqntid QK_NORM_BLOCK)
# 16-byte loads each thread has in flight: 4 streams large inputs at 91-97% of copy bandwidth (M >= 4096);
# a small input is latency-bound, and a thread's 4 vectors are 4 dependent reduce-and-store chains that run
# one after another, so it takes 1 (bench/NOTES.md, qk_norm at M = 16).
QK_NORM_VECS_PER_THREAD = 4
QK_NORM_VPT_CHOICES = (1, QK_NORM_VECS_PER_THREAD)
# inputs of at most this many vectors take vecs_per_thread 1: one vector per thread is then <= 128 CTAs, one wave
QK_NORM_SMALL_VECTORS = 128 * QK_NORM_BLOCK
QK_NORM_TILE = QK_NORM_BLOCK * QK_NORM_VECS_PER_THREAD  # vectors per CTA of the 4-vector build (the largest)
QK_NORM_GRID_RULE = (f"grid = (ceil(m * heads * head_dim / {QK_NORM_VEC_ELEMS} / ({QK_NORM_BLOCK} * "
                     f"vecs_per_thread)), 1, 1); block = ({QK_NORM_BLOCK}, 1, 1); m == 0 launches nothing")
# the flattened vector index is an Int32 in the kernel
QK_NORM_MAX_VECTORS = 2**31 - 1 - QK_NORM_TILE


@dataclass(frozen=True)
class QkNormVariant(VariantMixin):
    kernel: ClassVar[str] = "qk_norm"
    dtype: str
    head_dim: int
    has_scale: bool
    vecs_per_thread: int = QK_NORM_VECS_PER_THREAD  # QK_NORM_VPT_CHOICES; never changes a bit

    def __post_init__(self):
        if not supports_qk_norm(self.dtype, self.head_dim):
            raise ValueError(f"qk_norm does not support dtype={self.dtype} head_dim={self.head_dim}; "
                             f"supported dtypes {SUPPORTED_DTYPES}, head_dims {SUPPORTED_HEAD_DIMS}")
        if self.vecs_per_thread not in QK_NORM_VPT_CHOICES:
            raise ValueError(f"qk_norm vecs_per_thread must be one of {QK_NORM_VPT_CHOICES}, "
                             f"got {self.vecs_per_thread}")

    @property
    def tile(self) -> int:
        """16-byte vectors one CTA walks."""
        return QK_NORM_BLOCK * self.vecs_per_thread


def supports_qk_norm(dtype: str, head_dim: int) -> bool:
    return dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS


def qk_norm_variant(dtype: str, head_dim: int, scale: float, vectors: int | None = None) -> QkNormVariant:
    """The variant a call takes: scale == 1.0 needs no multiply; an input of <= QK_NORM_SMALL_VECTORS 16-byte
    vectors (qk_norm_vectors) takes one vector per thread. Without `vectors`: the large-input build."""
    small = vectors is not None and vectors <= QK_NORM_SMALL_VECTORS
    return QkNormVariant(dtype, head_dim, scale != 1.0, 1 if small else QK_NORM_VECS_PER_THREAD)


def qk_norm_variants(dtype: str, head_dim: int) -> tuple[QkNormVariant, ...]:
    """Every variant a model of this dtype/head_dim needs: with and without an output scale, for large and
    small inputs."""
    return tuple(QkNormVariant(dtype, head_dim, sc, vpt) for vpt in (QK_NORM_VECS_PER_THREAD, 1)
                 for sc in (False, True))


def qk_norm_vectors(head_dim: int, m: int, heads: int) -> int:
    """How many 16-byte vectors the kernel walks for an [m, heads*head_dim] input."""
    return m * heads * (head_dim // QK_NORM_VEC_ELEMS)


def launch_grid(variant: QkNormVariant, m: int, heads: int) -> tuple[int, int, int]:
    """The grid the qk_norm kernel must be launched with (the same rule its CuTe host code uses).

    (0, 1, 1) when m == 0 or heads == 0: the caller must then skip the launch.
    """
    m, heads = int(m), int(heads)
    if m < 0 or heads < 0:
        raise ValueError(f"qk_norm: m={m} and heads={heads} must be >= 0")
    n = qk_norm_vectors(variant.head_dim, m, heads)
    if n > QK_NORM_MAX_VECTORS:
        raise ValueError(f"qk_norm: m*heads*head_dim/{QK_NORM_VEC_ELEMS} = {n} exceeds {QK_NORM_MAX_VECTORS} "
                         "(the kernel indexes vectors with Int32)")
    return ((n + variant.tile - 1) // variant.tile, 1, 1)
