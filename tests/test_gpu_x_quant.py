"""x_quant on the GPU (issue 30): every byte and scale equal to musekern.reference.quantize_x_per_token's (vLLM's
dynamic per-token quantization), on rows built to hit its edges."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rows(m: int, g) -> torch.Tensor:
    """Random rows at spread magnitudes, plus edge rows: all zeros (the minimum scale), one with amax a power of two
    times 448 (a power-of-two scale: the products path), tiny values (below the minimum scale's reach), huge ones."""
    x = torch.randn(m, 8192, device="cuda", generator=g) * torch.exp2(
        torch.randint(-20, 20, (m, 1), device="cuda", generator=g).float())
    if m >= 5:
        x[0] = 0
        x[1, 5] = 448 * 2.0 ** 3
        x[1].clamp_(-448 * 2.0 ** 3, 448 * 2.0 ** 3)
        x[2] = torch.randn(8192, device="cuda", generator=g) * 1e-9
        x[3] = torch.randn(8192, device="cuda", generator=g) * 3e30
    return x.to(torch.bfloat16)


# M: one row, a GEMM-path M above the front (17), many rows; a row stride past the 8192 columns (a view)
@pytest.mark.parametrize("m", [1, 17, 1000])
@pytest.mark.parametrize("strided", [False, True])
def test_bytes_equal_the_reference(m, strided):
    from musekern.ops import x_quant
    from musekern.reference import quantize_x_per_token

    g = torch.Generator(device="cuda").manual_seed(m + 7 * strided)
    x = _rows(m, g)
    if strided:
        x = torch.cat([x, torch.zeros(m, 64, device="cuda", dtype=torch.bfloat16)], dim=1)[:, :8192]
    q, s = x_quant.quantize(x)
    torch.cuda.synchronize()
    qr, sr = quantize_x_per_token(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    q2, s2 = x_quant.quantize(x)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
