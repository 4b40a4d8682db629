"""The GEMM path's y = x @ W^T for an e4m3 weight (issue 30): every M the FP8 front builds do not serve (M > 16).

The weight is musekern.weights.pack's canonical pair (float8_e4m3fn [N, 8192] + float32 dequant multipliers); the
scale's rank picks the arithmetic:

- "channel" ([N]: per-channel and per-tensor checkpoints): W8A8 as vLLM's Hopper path (research/fp8.md section 2):
  x quantized per token (`reference.quantize_x_per_token`'s bytes: s = max(amax / 448, 1 / (448 * 512)), e4m3 of
  clamp(x / s); the op passes the x_quant kernel that computes them), then `torch._scaled_mm` (cuBLASLt FP8,
  row-wise scales: y = (q_x @ q_w^T) * s_x[m] * s_w[n] in fp32, one bf16 rounding) straight into y. Its shape rules
  (K and N multiples of 16, no rule on M: torch's ScaledBlas.cpp) hold for every call the op accepts (K = 8192,
  N a multiple of 64): no padding.
- "block" ([N // 64, 64]): W8A8 as vLLM's block path (research/fp8.md section 2): x quantized per token and 128-column
  group (`reference.quantize_x_per_group`'s bytes, the x_quant kernel's group build), then `torch._scaled_mm` with
  1x128 block scales on both sides (cuBLASLt's block scaling, sm_90 with CUDA >= 12.9: each 128-column block's product
  scaled by s_x[m, kb] * s_w[n, kb] in fp32, one bf16 rounding; M padded to a multiple of 4, BLOCK_MM_ROWS),
  through torch's call. That call faults in CUDA-graph replay after earlier graphs in a process (an illegal memory
  access; musekern's own call of the same cuBLASLt kernels faulted too and was dropped: bench/NOTES.md "e4m3
  weights"): ops.qkv_front.prepare warns for the M it serves (`note_torch_block_call`). The weight's scales go per
  row ([N, 64], each 64-row scale repeated: exact for the half-block shards, where a 128x128 form would not be), one
  small copy a call (N * 256 bytes). Where torch does not serve block scaling (another GPU or
  device, an older CUDA): the weight dequantized into a bf16 scratch copy (`pack.dequantize_tensors`; exact where the
  scales are powers of two, ue8m0) and the bf16 GEMM (`tune.mm`): no x rounding, but a full bf16 weight written and
  read a call.

Pure functions of their tensors: torch ops on x's device and stream, no host sync, capturable in a CUDA graph. The
caller has checked the call (ops/qkv_front.py) and runs the fused epilogue on y after.
"""
from __future__ import annotations

import functools
import logging
import warnings

import torch

from ..reference import FP8_K_GROUP, quantize_x_per_group, quantize_x_per_token
from ..weights.pack import GROUP_ROWS, dequantize_tensors
from . import tune


def quantize_reference(x: torch.Tensor, group: int = 0, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The x_quant kernel's (q, s) in torch (musekern.reference's bytes): per token ([M, 1]) or per token and
    `group` columns ([M, K / group], column-major as the kernel writes them), padded to `rows` (q 0, s 1). Several
    passes over x: the op passes the kernel's launch (ops.x_quant.quantize: one pass; torch's form cost 2.9x
    _scaled_mm's own time at TP8 M = 1024, bench/NOTES.md)."""
    q, s = quantize_x_per_group(x) if group else quantize_x_per_token(x)
    pad = (rows or x.shape[0]) - x.shape[0]
    if pad:
        q = torch.cat([q, torch.zeros(pad, q.shape[1], dtype=q.dtype, device=q.device)])
        s = torch.cat([s, torch.ones(pad, s.shape[1], dtype=s.dtype, device=s.device)])
    return (q, s.t().contiguous().t()) if group else (q, s)


def mm_channel(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
               quantize=quantize_reference) -> torch.Tensor:
    """out = bf16((e4m3(x / s_x) @ weight^T) * s_x * weight_scale): x bf16 [M, 8192], weight float8_e4m3fn
    [N, 8192], weight_scale float32 [N], out bf16 [M, N] (all contiguous, one device). `quantize(x, group) -> (q, s)`
    (`quantize_reference`'s contract)."""
    q, s = quantize(x, 0)
    return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16,
                            out=out)


BLOCK_MM_ROWS = 4  # cuBLASLt's block scaling refuses M = 17 (CUBLAS_STATUS_NOT_SUPPORTED, H100, torch 2.11 + CUDA 13.0)
# and serves 64 and 100: x and its scales go padded to a multiple of 4 rows (vLLM pads its CUTLASS blockwise GEMM's M
# to 4 alike)


def _block_scaled_mm(q, w, sx, sw_t, out):
    """torch._scaled_mm's 1x128 x 1x128 block form: sx [M, K / 128] and sw_t [K / 128, N] ([N, K / 128]
    column-major) fp32, mat2 = w^T."""
    return torch._scaled_mm(q, w.t(), scale_a=sx, scale_b=sw_t, out_dtype=torch.bfloat16, out=out)


def _block_scaled_mm_v2(q, w, sx, sw_t, out):
    """The same through torch.nn.functional.scaled_mm (the recipe API of newer torch: no `out`, one copy)."""
    f = torch.nn.functional
    b = f.ScalingType.BlockWise1x128
    return out.copy_(f.scaled_mm(q, w.t(), sx, b, sw_t.t(), b, output_dtype=torch.bfloat16))


@functools.lru_cache(maxsize=None)
def block_scaled_mm(device: torch.device):
    """The form of torch's 1x128 block-scaled FP8 GEMM this torch serves on `device` (cuBLASLt's block scaling:
    sm_90, CUDA 12.9+), or None: found once a device by a one-block call of each (no host sync; the op's prepare asks
    before any capture)."""
    if device.type != "cuda":
        return None
    q = torch.zeros(16, 2 * FP8_K_GROUP, dtype=torch.float8_e4m3fn, device=device)
    s = torch.ones(2, 16, device=device)  # two blocks in K: one would read as the row-wise form
    for form in (_block_scaled_mm, _block_scaled_mm_v2):
        try:
            form(q, q, s.t(), s, torch.empty(16, 16, dtype=torch.bfloat16, device=device))
            return form
        except (RuntimeError, ValueError, AttributeError, NotImplementedError):
            continue
    warnings.warn(f"torch {torch.__version__} (CUDA {torch.version.cuda}) serves no block-scaled FP8 GEMM on "
                  f"{torch.cuda.get_device_name(device)}: FP8 block checkpoints above M = 16 dequantize the weight to "
                  f"a bf16 copy every call (correct, several times slower); a torch built with CUDA 12.9+ on an sm_90 "
                  f"GPU serves it", RuntimeWarning, stacklevel=2)
    return None


def weight_scales_per_row(weight_scale: torch.Tensor) -> torch.Tensor:
    """[N // 64, K / 128] block scales -> [K / 128, N] contiguous (each 64-row scale repeated over its rows): the 1x128
    form's weight scales, [N, K / 128] column-major, seen transposed as torch._scaled_mm's mat2 (K x N) takes them."""
    return weight_scale.t().repeat_interleave(GROUP_ROWS, dim=1)


log = logging.getLogger("musekern.gemm")


def block_rows(m: int) -> int:
    """The rows the 1x128 GEMM runs for M tokens: M padded to BLOCK_MM_ROWS."""
    return -(-m // BLOCK_MM_ROWS) * BLOCK_MM_ROWS


def note_torch_block_call(n: int, ms) -> None:
    """The one warning where the 1x128 GEMM of weight rows `n` serves the M values `ms`: torch's call has faulted in
    CUDA-graph replay, so the engine should know before it captures (ops.qkv_front.prepare)."""
    log.warning("N = %d, M = %s: the block-scaled FP8 GEMM is torch's 1x128 _scaled_mm, which has faulted in "
                "CUDA-graph replay (an illegal memory access; torch 2.11, H100 and H200: bench/NOTES.md \"e4m3 "
                "weights\"); eager calls have not: keep these M out of captured graphs", n, ",".join(map(str, ms)))


def mm_block(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
             quantize=quantize_reference) -> torch.Tensor:
    """out = bf16(sum over 128-column blocks kb of (q_x @ weight^T)_kb * s_x[m, kb] * s_w[n, kb]): weight_scale float32
    [N // 64, 64] (module docstring; the bf16 copy's GEMM where block scaling is not served)."""
    form = block_scaled_mm(x.device)
    if form is None:
        return tune.mm(x, dequantize_tensors(weight, weight_scale).to(torch.bfloat16), out)
    m = x.shape[0]
    rows = block_rows(m)
    q, s = quantize(x, FP8_K_GROUP, rows)
    y = out if rows == m else torch.empty(rows, out.shape[1], dtype=out.dtype, device=out.device)
    sw = weight_scales_per_row(weight_scale)
    form(q, weight, s, sw, y)
    return out if y is out else out.copy_(y[:m])


def mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
       quantize=quantize_reference) -> torch.Tensor:
    """`mm_channel` for a [N] scale, `mm_block` for a [N // 64, 64] one (`quantize`: `quantize_reference`'s
    contract; the op passes ops.x_quant.quantize)."""
    if weight_scale.dim() == 1:
        return mm_channel(x, weight, weight_scale, out, quantize)
    return mm_block(x, weight, weight_scale, out, quantize)
