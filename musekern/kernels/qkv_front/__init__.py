"""qkv_front: the fused Muse Spark decode attention front (seed 000). See musekern/kernels/base.py for the files;
rules.py holds the planner's measured rules (not part of any key), ring.py the kernel's shared memory, mma.py and
octets.py its consumer and owner-epilogue roles."""
from __future__ import annotations

from ...model import FRONT_MAX_TOKENS, supports_shape
from ..base import KernelSpec
from .abi import abi_for
from .rules import qkv_front_variants, served_tokens
from .variant import QkvFrontVariant


def planned(model, shard, target) -> tuple:
    """The builds the rules give every M up to max_decode_tokens on this shard and target."""
    if not supports_shape(shard.n, shard.num_kv_heads):
        return ()
    wf = model.weight_format
    return qkv_front_variants(shard.n, shard.num_kv_heads, target, model.max_decode_tokens, model.kv_cache_dtype,
                              wf.dtype, wf.kernel_scale)


def tokens_served(v: QkvFrontVariant, target, max_tokens: int) -> str:
    """The M values the rules send to this build on `target`, e.g. '1-7', '8', '9-16' ('' for a build the plan does
    not take, e.g. one given by --variant)."""
    ms = served_tokens(v.n, v.num_kv_heads, target, max_tokens, v.kv_cache_dtype, v.weight_dtype,
                       v.weight_scale).get(v, [])
    if not ms:
        return ""
    return str(ms[0]) if len(ms) == 1 else f"{ms[0]}-{ms[-1]}"


def plan_row(v: QkvFrontVariant, model, shard, target) -> dict:
    return {"N": v.n, "heads": v.heads, "q_heads": v.num_q_heads, "kv_heads": v.num_kv_heads, "k_split": v.k_split,
            "stages": v.stages, "tiles": v.tiles, "fixed_rows": v.fixed_rows, "kv_cache_dtype": v.kv_cache_dtype,
            "weight_dtype": v.weight_dtype, "weight_scale": v.weight_scale,
            "tokens": tokens_served(v, target, model.max_decode_tokens if model else FRONT_MAX_TOKENS)}


KERNEL = KernelSpec("qkv_front", QkvFrontVariant, planned, abi_for, f"{__name__}.kernel", plan_row)
