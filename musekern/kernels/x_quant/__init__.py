"""x_quant: e4m3 quantization of x (per token, or per token and 128-column group) for the W8A8 GEMM path of FP8
weights (issue 30). See musekern/kernels/base.py for the files."""
from __future__ import annotations

from ..base import KernelSpec
from .abi import abi_for
from .variant import XQ_GROUP, XQuantVariant


def planned(model, shard, target) -> tuple:
    """The W8A8 GEMM path's build for FP8 checkpoints: per token for per-row weight scales, per group for block
    ones; and per group where a fused front build of the shard reads x quantized ahead (x_dtype fp8_e4m3)."""
    wf = model.weight_format
    if not wf.fp8:
        return ()
    from ..qkv_front import planned as front_planned

    ahead = shard is not None and any(v.x_dtype != "bf16" for v in front_planned(model, shard, target))
    groups = {XQ_GROUP if wf.kernel_scale == "block" else 0} | ({XQ_GROUP} if ahead else set())
    return tuple(XQuantVariant(group=g) for g in sorted(groups))


def plan_row(v: XQuantVariant, model, shard, target) -> dict:
    return {"N": shard.n if shard else None, "heads": None}


KERNEL = KernelSpec("x_quant", XQuantVariant, planned, abi_for, f"{__name__}.kernel", plan_row)
