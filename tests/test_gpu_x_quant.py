"""x_quant on the GPU (issue 30): every byte and scale equal to musekern.reference's (vLLM's dynamic per-token and
per-token-group quantizations), on rows built to hit their edges."""
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


# M: one row, a GEMM-path M above the front (17), many rows; a row stride past the 8192 columns (a view); both builds
@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("m", [1, 17, 1000])
@pytest.mark.parametrize("strided", [False, True])
def test_bytes_equal_the_reference(m, strided, group):
    from musekern.gemm.fp8 import quantize_reference
    from musekern.ops import x_quant

    g = torch.Generator(device="cuda").manual_seed(m + 7 * strided)
    x = _rows(m, g)
    if group and m >= 5:  # a group of zeros (the floor), one of tiny values, one at a power of two times 448
        x[4, :128] = 0
        x[4, 128:256] = 1e-30
        x[4, 256:384].clamp_(-448 * 4.0, 448 * 4.0)
        x[4, 300] = 448 * 4.0
    if strided:
        x = torch.cat([x, torch.zeros(m, 64, device="cuda", dtype=torch.bfloat16)], dim=1)[:, :8192]
    rows = m + 3 if m == 17 else None  # padded rows (the block GEMM's M rounded up to 4)
    q, s = x_quant.quantize(x, group, rows)
    torch.cuda.synchronize()
    qr, sr = quantize_reference(x, group, rows)
    assert s.shape == sr.shape and (s.shape[0] == 1 or s.stride() == sr.stride())  # (one row: any stride)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    q2, s2 = x_quant.quantize(x, group, rows)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
