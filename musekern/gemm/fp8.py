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
  through torch's call, or musekern's own cuBLASLt call for the shapes `prepare_blocks` kept (gemm/cublaslt.py's
  E4M3_BLOCKS form: the algorithm torch's call takes, a workspace of its own each call). torch's call faults in
  CUDA-graph replay (an illegal memory access, bench/NOTES.md "e4m3 weights"); the own call is built to avoid that,
  and ops.qkv_front.prepare takes it once a GPU round shows it replays clean (bench/probes/round84.sh). The
  weight's scales go per row ([N, 64], each 64-row scale repeated: exact for the half-block shards, where a 128x128
  form would not be), one small copy a call (N * 256 bytes). Where torch does not serve block scaling (another GPU or
  device, an older CUDA): the weight dequantized into a bf16 scratch copy (`pack.dequantize_tensors`; exact where the
  scales are powers of two, ue8m0) and the bf16 GEMM (`tune.mm`): no x rounding, but a full bf16 weight written and
  read a call.

Pure functions of their tensors: torch ops on x's device and stream, no host sync, capturable in a CUDA graph. The
caller has checked the call (ops/qkv_front.py) and runs the fused epilogue on y after.
"""
from __future__ import annotations

import functools
import logging
import threading
import warnings

import torch

from ..model import HIDDEN
from ..reference import FP8_K_GROUP, quantize_x_per_group, quantize_x_per_token
from ..runtime.loader import current_stream_getter
from ..weights.pack import GROUP_ROWS, dequantize_tensors
from . import cublaslt, tune


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


_LT: dict = {}  # (N, rows, device) -> (launch, workspace bytes): `prepare_blocks`'s own cuBLASLt calls
_LT_LOCK = threading.Lock()
SCALE_ALIGNMENT = 16  # cuBLASLt's scale tensors: 16-byte aligned
_stream = current_stream_getter()  # device index -> torch's current stream there, as a raw handle
log = logging.getLogger("musekern.gemm")


def prepare_blocks(n: int, ms, device: int) -> dict:
    """musekern's own cuBLASLt call of the 1x128 form for weight rows `n` and each M in `ms` (padded to
    BLOCK_MM_ROWS): the heuristic's algorithms in its order (torch's call takes its first under torch's workspace),
    the first whose y on random e4m3 inputs and scales is torch's call's (within tune.CHECK_RTOL of max |y|) kept for
    `mm_block`. Returns {rows: the kept algorithm's name, or why none} for the rows not kept before; where none,
    `mm_block` takes torch's call, and `note_torch_block_call` names those M. Two GEMMs a padded M and a sync: call
    before capture, never inside."""
    dev = torch.device("cuda", device)
    form = block_scaled_mm(dev)
    with _LT_LOCK, torch.cuda.device(device):
        todo = sorted({block_rows(m) for m in ms} - {r for (nn, r, d) in _LT if nn == n and d == device})
        if not todo or form is None:
            return {r: "torch serves no block-scaled FP8 GEMM here" for r in todo}
        try:
            lib = cublaslt.library()
        except cublaslt.CublasLtError as e:
            note_torch_block_call(n, ms, str(e))
            return {r: str(e) for r in todo}
        g = torch.Generator(device=dev).manual_seed(n)
        w = (torch.rand(n, HIDDEN, device=dev, generator=g) * 2 - 1).mul_(448).to(torch.float8_e4m3fn)
        sw = torch.rand(HIDDEN // FP8_K_GROUP, n, device=dev, generator=g).add_(0.5).div_(448 * 64)
        out = {}
        for rows in todo:
            q = (torch.rand(rows, HIDDEN, device=dev, generator=g) * 2 - 1).mul_(448).to(torch.float8_e4m3fn)
            sx = torch.rand(HIDDEN // FP8_K_GROUP, rows, device=dev, generator=g).add_(0.5).div_(448).t()
            want = form(q, w, sx, sw, torch.empty(rows, n, dtype=torch.bfloat16, device=dev)).float()
            tol = tune.CHECK_RTOL * want.abs().max().item()
            y = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
            try:  # a library that cannot describe or plan this call leaves torch's
                mat, why = cublaslt.Matmul(lib, n, rows, device, cublaslt.E4M3_BLOCKS), "no algorithm offered"
                mat.set_scales(sw.data_ptr(), sx.data_ptr())
                cands = mat.candidates()
            except cublaslt.CublasLtError as e:
                cands, why = [], str(e)
            for cand in cands:
                f = mat.launcher(cand)
                ws = torch.empty(max(cand.workspace, 1), dtype=torch.uint8, device=dev)
                y.fill_(float("nan"))
                try:
                    f(w.data_ptr(), q.data_ptr(), y.data_ptr(), ws.data_ptr(), _stream(device), sw.data_ptr(),
                      sx.data_ptr())
                    err = (y.float() - want).abs().max().item()
                except cublaslt.CublasLtError as e:
                    err, why = float("nan"), str(e)
                if err <= tol:
                    _LT[(n, rows, device)] = (f, cand.workspace)
                    out[rows] = cand.name
                    break
                if err == err:
                    why = f"{cand.name}: max |y - torch's| = {err:.3g} > {tol:.3g}"
            else:
                out[rows] = why
        torch.cuda.synchronize(device)
    left = [m for m in ms if (n, block_rows(m), device) not in _LT]
    if left:
        note_torch_block_call(n, left, "; ".join(sorted({out[block_rows(m)] for m in left})))
    return out


def block_rows(m: int) -> int:
    """The rows the 1x128 GEMM runs for M tokens: M padded to BLOCK_MM_ROWS."""
    return -(-m // BLOCK_MM_ROWS) * BLOCK_MM_ROWS


def note_torch_block_call(n: int, ms, why: str | None = None) -> None:
    """The one warning where the 1x128 GEMM of weight rows `n` at the M values `ms` is torch's call (`why` no own call
    was kept for them, where one was tried): that call has faulted in CUDA-graph replay, so the engine should know
    before it captures (ops.qkv_front.prepare, `prepare_blocks`)."""
    log.warning("N = %d, M = %s: the block-scaled FP8 GEMM is torch's 1x128 _scaled_mm%s, which has faulted in "
                "CUDA-graph replay (an illegal memory access; torch 2.11, H100 and H200: bench/NOTES.md \"e4m3 "
                "weights\"); eager calls have not: keep these M out of captured graphs", n, ",".join(map(str, ms)),
                f" (no own cuBLASLt call: {why})" if why else "")


def _lt_block_mm(q, w, sx, sw_t, out) -> bool:
    """`_block_scaled_mm` through the call `prepare_blocks` kept for this shape: True, or False (nothing launched)
    where none was kept or a pointer is not aligned as the call assumes."""
    dev = q.get_device()
    run = _LT.get((w.shape[0], q.shape[0], dev))
    if run is None or (q.data_ptr() | w.data_ptr() | out.data_ptr()) % cublaslt.ALIGNMENT \
            or (sx.data_ptr() | sw_t.data_ptr()) % SCALE_ALIGNMENT:
        return False
    if dev != torch.cuda.current_device():  # the handle and stream are x's device's: launch there
        with torch.cuda.device(dev):
            return _lt_block_mm(q, w, sx, sw_t, out)
    launch, ws = run
    workspace = torch.empty(ws, dtype=torch.uint8, device=q.device) if ws else None  # stream-ordered, per call
    launch(w.data_ptr(), q.data_ptr(), out.data_ptr(), workspace.data_ptr() if ws else 0, _stream(dev),
           sw_t.data_ptr(), sx.data_ptr())
    return True


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
    if not _lt_block_mm(q, weight, s, sw, y):
        form(q, weight, s, sw, y)
    return out if y is out else out.copy_(y[:m])


def mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor,
       quantize=quantize_reference) -> torch.Tensor:
    """`mm_channel` for a [N] scale, `mm_block` for a [N // 64, 64] one (`quantize`: `quantize_reference`'s
    contract; the op passes ops.x_quant.quantize)."""
    if weight_scale.dim() == 1:
        return mm_channel(x, weight, weight_scale, out, quantize)
    return mm_block(x, weight, weight_scale, out, quantize)
