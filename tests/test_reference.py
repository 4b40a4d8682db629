"""The vectorized plain-torch reference (musekern.reference) against a straightforward per-token loop written
here from the contract, on CPU: random inputs, padding, slots past the cache, the last slot, positions out of range,
both cache layouts, M up to a few thousand; duplicate slots (undefined, bounded); and that it scales: the number
of torch operations it dispatches does not depend on M (no per-token Python loop, no host sync by .tolist())."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kv_layouts import paged_caches  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from musekern.reference import fused_qknorm_rope_kv_insert, insert_cache_rows, rope_cos_sin_table  # noqa: E402

D = 64
EPS = 1e-6


def loop_epilogue(y, positions, cs, slots, kc, vc, nkv, eps):
    """The contract, token by token and head by head (fp32 math on the bf16 values, one rounding)."""
    m, n = y.shape
    heads = n // D
    nq = (heads - 2 * nkv) // 2
    out = y.clone()
    nb, bs = kc.shape[0], kc.shape[1]
    for t in range(m):
        p = min(max(int(positions[t]), 0), cs.shape[0] - 1)
        c, s = cs[p, :D // 2].float(), cs[p, D // 2:].float()
        for h in range(nq + nkv):
            v = y[t, h * D:(h + 1) * D].float()
            v = v * torch.rsqrt(v.pow(2).mean() + eps)
            a, b = v[0::2], v[1::2]
            out[t, h * D:(h + 1) * D] = torch.stack((a * c - b * s, a * s + b * c), -1).reshape(D).to(torch.bfloat16)
        slot = int(slots[t])
        if 0 <= slot < nb * bs:
            kc[slot // bs, slot % bs] = out[t, nq * D:(nq + nkv) * D].view(nkv, D)
            vc[slot // bs, slot % bs] = out[t, (nq + nkv) * D:(nq + 2 * nkv) * D].view(nkv, D)
    return out


def make(m, nkv, layout, seed, num_blocks=64, block_size=16, max_pos=512):
    g = torch.Generator().manual_seed(seed)
    n = (2 * 4 * nkv + 2 * nkv) * D
    y = (torch.randn(m, n, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(-5, max_pos + 5, (m,), generator=g)
    cap = num_blocks * block_size
    slots = torch.randperm(cap, generator=g)[:m] if m <= cap else torch.randperm(m, generator=g) - (m - cap)
    slots = slots.clone()  # (m > cap: the first m - cap of a permutation of -(m-cap)..cap-1 are negative)
    slots[::5] = -1
    if m > 2:
        slots[slots == cap - 1] = -1
        slots[2] = cap - 1  # the last slot of the cache
        slots[1] = cap + 3  # past the end
    kc, vc, kv = paged_caches(num_blocks, block_size, nkv, layout)
    return y, pos, rope_cos_sin_table(max_pos, 10000.0), slots, kc, vc, kv


# M: one token, one that is all padding, a few, a thousand, a few thousand (more tokens than slots: many padded);
# nkv 1 and 2; both engine layouts.
@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
@pytest.mark.parametrize("m,nkv", [(1, 1), (5, 2), (37, 1), (1000, 2), (3000, 1)])
def test_vectorized_equals_the_loop(m, nkv, layout):
    y, pos, cs, slots, kc, vc, kv = make(m, nkv, layout, seed=m + nkv)
    kv_loop = kv.clone()
    kc2, vc2 = (kv_loop[0], kv_loop[1]) if layout == "vllm" else (kv_loop[:, 0], kv_loop[:, 1])
    want = loop_epilogue(y, pos, cs, slots, kc2, vc2, nkv, EPS)
    got = fused_qknorm_rope_kv_insert(y, pos, cs, slots, kc, vc, nkv, EPS)
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_loop)  # both caches, every element (the sentinel outside the written slots)


def test_all_padding_writes_nothing():
    y, pos, cs, slots, kc, vc, kv = make(6, 1, "flashinfer", seed=3)
    before = kv.clone()
    slots[:] = torch.tensor([-1, -2, 1024, 10**9, -1, 1024 + 16])
    fused_qknorm_rope_kv_insert(y, pos, cs, slots, kc, vc, 1, EPS)
    assert torch.equal(kv, before)


def test_zero_tokens():
    y, pos, cs, slots, kc, vc, kv = make(0, 1, "vllm", seed=1)
    before = kv.clone()
    out = fused_qknorm_rope_kv_insert(y, pos, cs, slots, kc, vc, 1, EPS)
    assert out.shape == y.shape and torch.equal(kv, before)


def test_duplicate_slots_are_bounded():
    """Undefined which token a doubly-mapped slot holds (the kernels: per 16-byte piece), but it holds one of them
    piecewise, and every other slot is exact."""
    rows = torch.randn(4, 2, D).to(torch.bfloat16)
    cache = torch.full((3, 2, 2, D), -7.0, dtype=torch.bfloat16)
    insert_cache_rows(cache, torch.tensor([3, 1, 3, -1]), rows)
    assert torch.equal(cache[0, 1], rows[1])
    pieces = cache[1, 1].reshape(-1, 8)
    a, b = rows[0].reshape(-1, 8), rows[2].reshape(-1, 8)
    assert all(torch.equal(p, x) or torch.equal(p, z) for p, x, z in zip(pieces, a, b, strict=True))
    untouched = torch.ones(3, 2, dtype=torch.bool)
    untouched[0, 1] = untouched[1, 1] = False
    assert bool((cache[untouched] == -7.0).all())


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(m):
    y, pos, cs, slots, kc, vc, _ = make(m, 2, "flashinfer", seed=5)
    with _Count() as c:
        fused_qknorm_rope_kv_insert(y, pos, cs, slots, kc, vc, 2, EPS)
    return c


def test_operation_count_does_not_depend_on_m():
    small, large = _ops(3), _ops(3000)
    assert small.ops == large.ops and small.ops < 120, (small.ops, large.ops)
    # no host round trip: nothing reads a tensor's values back to Python
    assert not any(n.startswith(("aten._local_scalar_dense", "aten.item", "aten.nonzero")) for n in large.names)
