"""qkv_epilogue: the attention front's fused epilogue on a GEMM's y (every M the fused front does not take). See
musekern/kernels/base.py for the files."""
from __future__ import annotations

from ...model import supports_shape
from ..base import KernelSpec
from .abi import abi_for
from .variant import QkvEpilogueVariant, qkv_epilogue_variants, rows_served


def planned(model, shard, target) -> tuple:
    """Every build the rule picks (one build serves every N): for each shard the kernels can serve."""
    return qkv_epilogue_variants(model.kv_cache_dtype) if supports_shape(shard.n, shard.num_kv_heads) else ()


def plan_row(v: QkvEpilogueVariant, model, shard, target) -> dict:
    """One build serves every N: the M the rule sends to it for this shard."""
    served = rows_served(v, shard.n, shard.num_kv_heads) if shard else None
    return {"N": shard.n if shard else None, "heads": None, "kv_cache_dtype": v.kv_cache_dtype,
            "tokens": f"{served[0]}-{served[1]}" if served else ""}


KERNEL = KernelSpec("qkv_epilogue", QkvEpilogueVariant, planned, abi_for, f"{__name__}.kernel", plan_row)
