"""Planner for qk_norm: unweighted RMS norm per head_dim group (seed 002)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import VariantMixin

SUPPORTED_DTYPES = ("bfloat16", "float16")
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # one row of 16-byte vectors per warp slice; see kernels/qk_norm.py

# Launch geometry of the qk_norm kernel (kernels/qk_norm.py imports these: single source of truth).
# The [M, heads*head_dim] input is seen as M*heads*head_dim/VEC_ELEMS 16-byte vectors, flattened
# row-major; thread t of CTA b handles vectors b*TILE + u*BLOCK + t for u < VECS_PER_THREAD, and the
# head_dim/VEC_ELEMS consecutive lanes that share one (row, head) reduce with butterfly shuffles.
QK_NORM_VEC_ELEMS = 8  # 16 bytes of bf16/fp16 per load and store
QK_NORM_BLOCK = 256  # threads per CTA (the kernel is compiled with .reqntid QK_NORM_BLOCK)
QK_NORM_VECS_PER_THREAD = 4  # independent 16-byte loads each thread has in flight
QK_NORM_TILE = QK_NORM_BLOCK * QK_NORM_VECS_PER_THREAD  # vectors per CTA
QK_NORM_GRID_RULE = (f"grid = (ceil(m * heads * head_dim / {QK_NORM_VEC_ELEMS} / {QK_NORM_TILE}), 1, 1); "
                     f"block = ({QK_NORM_BLOCK}, 1, 1); m == 0 launches nothing")
# the flattened vector index is an Int32 in the kernel
QK_NORM_MAX_VECTORS = 2**31 - 1 - QK_NORM_TILE


@dataclass(frozen=True)
class QkNormVariant(VariantMixin):
    kernel: ClassVar[str] = "qk_norm"
    dtype: str
    head_dim: int
    has_scale: bool

    def __post_init__(self):
        if not supports_qk_norm(self.dtype, self.head_dim):
            raise ValueError(f"qk_norm does not support dtype={self.dtype} head_dim={self.head_dim}; "
                             f"supported dtypes {SUPPORTED_DTYPES}, head_dims {SUPPORTED_HEAD_DIMS}")


def supports_qk_norm(dtype: str, head_dim: int) -> bool:
    return dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS


def qk_norm_variant(dtype: str, head_dim: int, scale: float) -> QkNormVariant:
    """The variant a call takes: scale == 1.0 needs no multiply."""
    return QkNormVariant(dtype, head_dim, scale != 1.0)


def qk_norm_variants(dtype: str, head_dim: int) -> tuple[QkNormVariant, ...]:
    """Both variants a model of this dtype/head_dim needs (with and without an output scale)."""
    return (QkNormVariant(dtype, head_dim, False), QkNormVariant(dtype, head_dim, True))


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
    return ((n + QK_NORM_TILE - 1) // QK_NORM_TILE, 1, 1)
