"""x_quant: per-token e4m3 quantization of x for the W8A8 GEMM path of FP8 weights (issue 30). See
musekern/kernels/base.py for the files."""
from __future__ import annotations

from ..base import KernelSpec
from .abi import abi_for
from .variant import XQuantVariant


def planned(model, shard, target) -> tuple:
    """The one build, where the model's weights are FP8 with per-row scales (the W8A8 GEMM path takes it)."""
    wf = model.weight_format
    return (XQuantVariant(),) if wf.fp8 and wf.kernel_scale == "channel" else ()


def plan_row(v: XQuantVariant, model, shard, target) -> dict:
    return {"N": shard.n if shard else None, "heads": None}


KERNEL = KernelSpec("x_quant", XQuantVariant, planned, abi_for, f"{__name__}.kernel", plan_row)
