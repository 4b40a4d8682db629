"""gemm/fp8.py on CPU (torch's own _scaled_mm and mm): the channel path is vLLM's W8A8 arithmetic; the block path's
W8A8 form (torch's block-scaled _scaled_mm, CUDA only) gets scales of the shapes and strides torch's own checks (its
meta functions) take, and where block scaling is not served it is the bf16 dequantized copy's GEMM; neither syncs the
host. The same on the GPU, against fp64: tests/test_gpu_qkv_front.py.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from musekern.gemm import fp8  # noqa: E402
from musekern.reference import vllm_fp8_gemm  # noqa: E402
from musekern.weights.formats import parse_override  # noqa: E402
from musekern.weights.pack import dequantize, pack_rank, quantize_reference  # noqa: E402


def packed(fmt_name: str, seed: int = 0):
    """One rank of a synthetic checkpoint (one head each of q, k, v, gate: N = 256)."""
    fmt = parse_override(fmt_name)
    g = torch.Generator().manual_seed(seed)
    parts = {p: quantize_reference(torch.randn(64, 8192, generator=g) * 0.02, fmt) for p in ("q", "k", "v", "gate")}
    return pack_rank(fmt, parts, num_q_heads=1, num_kv_heads=1, tp=1, rank=0, gate=True)


def x_rows(m: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, 8192, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# M = 1 and 17 (no multiple of 16: _scaled_mm has no rule on M) and 64; per-channel and per-tensor checkpoints (both
# pack to per-row scales)
@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-tensor"])
@pytest.mark.parametrize("m", [1, 17, 64])
def test_channel_is_vllms_w8a8(fmt, m):
    p, x = packed(fmt), x_rows(m)
    out = torch.empty(m, p.n, dtype=torch.bfloat16)
    y = fp8.mm(x, p.weight, p.weight_scale, out)
    assert y is out
    want = vllm_fp8_gemm(x, p).double()  # exact sums, one fp32 rounding; y: another summation order, then bf16
    assert bool(((y.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-5 * want.abs().max()).all())


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-block-ue8m0"])
@pytest.mark.parametrize("m", [1, 17, 64])
def test_block_without_block_scaling_is_the_bf16_copys_gemm(fmt, m):
    p, x = packed(fmt), x_rows(m)
    assert fp8.block_scaled_mm(x.device) is None  # torch serves block scaling on CUDA (sm_90) only
    out = torch.empty(m, p.n, dtype=torch.bfloat16)
    y = fp8.mm(x, p.weight, p.weight_scale, out)
    assert y is out and torch.equal(y, torch.mm(x, dequantize(p).to(torch.bfloat16).t()))


def test_block_scales_as_torchs_block_form_takes_them():
    """The layouts mm_block hands torch._scaled_mm (x scales from quantize_reference, the weight's per row) pass the
    meta checks of both torch APIs (the recipe API checks strides too); the values are the reference's."""
    p, x = packed("fp8-block"), x_rows(17)
    q, s = fp8.quantize_reference(x, 128)
    from musekern.reference import quantize_x_per_group

    qr, sr = quantize_x_per_group(x)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr) and s.stride() == (1, 17)
    qp, sp = fp8.quantize_reference(x, 128, rows=20)  # padded to the block GEMM's multiple of 4 rows
    assert qp.shape == (20, 8192) and sp.shape == (20, 64) and sp.stride() == (1, 20)
    assert torch.equal(qp[:17].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:17], s)
    assert not qp[17:].view(torch.uint8).any() and bool((sp[17:] == 1).all())
    sw = fp8.weight_scales_per_row(p.weight_scale)
    assert sw.shape == (64, p.n) and sw.is_contiguous()
    assert torch.equal(sw.t(), p.weight_scale.repeat_interleave(64, dim=0))  # each 64-row scale on its rows
    meta = {k: v.to("meta") for k, v in dict(q=q, w=p.weight, sx=s, sw=sw).items()}
    meta["sx"] = torch.empty(64, 17, device="meta").t()  # .to() keeps no strides: the kernel's layout again
    y = torch._scaled_mm(meta["q"], meta["w"].t(), scale_a=meta["sx"], scale_b=meta["sw"], out_dtype=torch.bfloat16)
    assert y.shape == (17, p.n)
    f = torch.nn.functional
    if hasattr(f, "scaled_mm"):
        b = f.ScalingType.BlockWise1x128
        assert f.scaled_mm(meta["q"], meta["w"].t(), meta["sx"], b, meta["sw"].t(), b).shape == (17, p.n)
        with pytest.raises(RuntimeError, match="stride"):  # a row-major x scale is refused: the check is real
            f.scaled_mm(meta["q"], meta["w"].t(), meta["sx"].contiguous(), b, meta["sw"].t(), b)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel"])
def test_no_host_sync(fmt):
    """Graph-capturable: no op reads a device value back to the host (.item(), a data-dependent shape)."""
    p, x = packed(fmt), x_rows(5)
    with _Ops() as ops:
        fp8.mm(x, p.weight, p.weight_scale, torch.empty(5, p.n, dtype=torch.bfloat16))
    assert ops.names and not [n for n in ops.names if "local_scalar_dense" in n or "nonzero" in n]
