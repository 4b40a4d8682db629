"""The GEMM path's y = x @ W^T for an e4m3 weight (issue 30): every M the FP8 front builds do not serve (M > 16).

The weight is musekern.weights.pack's canonical pair (float8_e4m3fn [N, 8192] + float32 dequant multipliers); the
scale's rank picks the arithmetic:

- "channel" ([N]: per-channel and per-tensor checkpoints): W8A8 as vLLM's Hopper path (research/fp8.md section 2):
  x quantized per token (`reference.quantize_x_per_token`'s bytes: s = max(amax / 448, 1 / (448 * 512)), e4m3 of
  clamp(x / s); the op passes the x_quant kernel that computes them), then `torch._scaled_mm` (cuBLASLt FP8,
  row-wise scales: y = (q_x @ q_w^T) * s_x[m] * s_w[n] in fp32, one bf16 rounding) straight into y. Its shape rules
  (K and N multiples of 16, no rule on M: torch's ScaledBlas.cpp) hold for every call the op accepts (K = 8192,
  N a multiple of 64): no padding.
- "block" ([N // 64, 64]): the slow correct path, W8A16: the weight dequantized on the device into a bf16 scratch
  copy (`pack.dequantize_tensors`, then one bf16 rounding of each fp32 product; exact where the scales are powers of
  two, ue8m0) and the bf16 GEMM (`tune.mm`) on it: no x rounding, but a full bf16 weight written and read per call.
  A W8A8 blockwise GEMM (x per 128-column group, per-block scales inside the K loop, as DeepGEMM / vLLM's CUTLASS
  blockwise) is open.

Pure functions of their tensors: torch ops on x's device and stream, no host sync, capturable in a CUDA graph. The
caller has checked the call (ops/qkv_front.py) and runs the fused epilogue on y after.
"""
from __future__ import annotations

import torch

from ..reference import quantize_x_per_token
from ..weights.pack import dequantize_tensors
from . import tune


def mm_channel(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
               quantize=quantize_x_per_token) -> torch.Tensor:
    """out = bf16((e4m3(x / s_x) @ weight^T) * s_x * weight_scale): x bf16 [M, 8192], weight float8_e4m3fn
    [N, 8192], weight_scale float32 [N], out bf16 [M, N] (all contiguous, one device). `quantize(x) -> (q, s)`: the
    op passes the x_quant kernel's launch (ops/x_quant.py, one pass over x); the default is the reference's torch
    form (five passes: 2.9x _scaled_mm's own time at TP8 M = 1024, bench/NOTES.md "e4m3 weights")."""
    q, s = quantize(x)
    return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16,
                            out=out)


def mm_block(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ bf16(dequant(weight))^T: weight_scale float32 [N // 64, 64] (module docstring: the slow path)."""
    return tune.mm(x, dequantize_tensors(weight, weight_scale).to(torch.bfloat16), out)


def mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
       quantize=quantize_x_per_token) -> torch.Tensor:
    """`mm_channel` (with `quantize`) for a [N] scale, `mm_block` for a [N // 64, 64] one."""
    if weight_scale.dim() == 1:
        return mm_channel(x, weight, weight_scale, out, quantize)
    return mm_block(x, weight, weight_scale, out)
