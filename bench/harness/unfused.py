"""The unfused baseline: cuBLAS GEMM + the epilogue in plain torch, capturable in a CUDA graph.

musekern.reference.fused_qknorm_rope_kv_insert walks the slots with .tolist() (a host sync), which a
graph cannot capture; this is the same math with the cache insert done by index_put (no host sync),
so it equals the reference bit for bit (tests/test_bench.py) on slots inside the cache.
"""
from __future__ import annotations

import torch

HEAD_DIM = 64


def unfused_epilogue(y: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     num_kv_heads: int, eps: float) -> torch.Tensor:
    """qk RMS norm + interleaved RoPE on the bf16 GEMM result y [M, N], k/v written to the paged caches.

    Precondition (the bench's inputs meet it): every slot is in [0, num_blocks * block_size); a padding
    slot (< 0) would need a data-dependent skip, i.e. a host sync.
    """
    m, n = y.shape
    d = HEAD_DIM
    heads = n // d
    nkv = num_kv_heads
    nq = (heads - 2 * nkv) // 2
    yf = y.float().reshape(m, heads, d)
    qk = yf[:, :nq + nkv]
    qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)
    pos = positions.clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.float()[pos]
    c, s = cs[:, None, : d // 2], cs[:, None, d // 2:]
    a, b = qk[..., 0::2], qk[..., 1::2]
    roped = torch.stack((a * c - b * s, a * s + b * c), dim=-1).reshape(m, nq + nkv, d)
    out = torch.cat((roped, yf[:, nq + nkv:]), dim=1).reshape(m, n).to(torch.bfloat16)
    heads_out = out.view(m, heads, d)
    bs = key_cache.shape[1]
    blk, off = torch.div(slot_mapping, bs, rounding_mode="floor"), slot_mapping % bs
    key_cache[blk, off] = heads_out[:, nq:nq + nkv].to(key_cache.dtype)
    value_cache[blk, off] = heads_out[:, nq + nkv:nq + 2 * nkv].to(value_cache.dtype)
    return out


def unfused_front(x, weight, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_kv_heads, eps):
    """y = epilogue(bf16(x @ weight^T)) with torch.mm (cuBLAS on the GPU)."""
    return unfused_epilogue(torch.mm(x, weight.t()), positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                            num_kv_heads, eps)
