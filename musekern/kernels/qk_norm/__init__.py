"""qk_norm: unweighted RMS norm over each head_dim group (seed 002). See musekern/kernels/base.py for the files."""
from __future__ import annotations

from ..base import KernelSpec
from .abi import abi_for
from .variant import QkNormVariant, qk_norm_variants


def planned(model, shard, target) -> tuple:
    """Every build a model of this dtype and head_dim needs (the same for every shard and target)."""
    return qk_norm_variants(model.dtype, model.head_dim)


def plan_row(v: QkNormVariant, model, shard, target) -> dict:
    return {"N": shard.n if shard else None, "heads": None, "head_dim": v.head_dim, "dtype": v.dtype,
            "has_scale": v.has_scale}


KERNEL = KernelSpec("qk_norm", QkNormVariant, planned, abi_for, f"{__name__}.kernel", plan_row)
