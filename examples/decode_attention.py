"""A decoder attention block on musekern: the worked example of "Use it in an engine" (README).

One tensor-parallel rank of the bundled Muse Spark config (TP8: 16 q heads, 1 kv head, N = 2176):

    hidden [M, 8192] -> input RMSNorm -> torch.ops.musekern.qkv_front      (y = q | k | v | gate; k, v -> caches)
                     -> paged attention over the caches                  (reads only what the front wrote)
                     -> sigmoid(gate) * attn                               (the output gate)
                     -> o_proj -> [M, 8192]                                (this rank's partial sum)

M is every token of an engine step: prefill chunks and decode tokens of many requests together, padded
with slot -1 tokens (written nowhere, their outputs ignored). Per token the engine passes its position,
its cache slot (block_table[position // block_size] * block_size + position % block_size) and its request
(an index into the step's block tables).

Conventions:
- gate: y's last num_q_heads * 64 columns, one 64-wide gate per q head; the head's attention output is
  multiplied elementwise by sigmoid(gate) before o_proj (the Muse Spark / Qwen3-Next output gate);
- attention: softmax(q k^T * 64^-0.5) v with grouped kv heads (q head h reads kv head h // (nq / nkv)),
  token t attends to its request's keys at positions 0..positions[t] (causal within the step's chunk);
- caches: one `kv` tensor holding both caches (vLLM's [2, blocks, block_size, nkv, 64] or FlashInfer's NHD
  [blocks, 2, block_size, nkv, 64]), a buffer of the module: torch.compile then sees the two caches as views
  of one graph input and writes them in place (two separate cache inputs that share storage make inductor
  copy one whole cache per call), and CUDA graphs (mode="reduce-overhead") keep it at a static address.

The attention here gathers each token's pages and runs torch SDPA on them: exact and capturable (no host
sync, no data-dependent shape), memory O(M * max context). A production engine calls a paged decode kernel
(FlashInfer's BatchDecodeWithPagedKVCacheWrapper over (k_cache, v_cache) in NHD layout, or FlashAttention's
varlen kernel) at this point instead: the caches musekern writes are those kernels' layouts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import musekern.ops.library  # noqa: F401  (registers torch.ops.musekern.*)
from musekern.config import ShardShape, load_config
from musekern.reference import rope_cos_sin_table

HEAD = 64
LAYOUTS = ("vllm", "flashinfer")


@dataclass(frozen=True)
class AttentionWeights:
    """One rank's weights: input-norm gain [hidden], fused q|k|v|gate projection [N, hidden], o_proj [hidden, nq*64]."""
    norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor


def random_weights(shard: ShardShape, hidden: int = 8192, seed: int = 0, device=None,
                   dtype=torch.bfloat16) -> AttentionWeights:
    """Weights of unit-scale activations: projections with std 1/sqrt(fan_in), norm gains around 1."""
    g = torch.Generator().manual_seed(seed)
    nq = shard.num_q_heads * HEAD
    norm = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    qkv = torch.randn(shard.n, hidden, generator=g) / hidden ** 0.5
    o = torch.randn(hidden, nq, generator=g) / nq ** 0.5
    return AttentionWeights(*(t.to(device=device, dtype=dtype) for t in (norm, qkv, o)))


def make_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, layout: str = "vllm", device=None,
                  fill: float = 0.0) -> torch.Tensor:
    """Both caches in one tensor, in an engine layout (see `cache_views`)."""
    if layout == "vllm":
        shape = (2, num_blocks, block_size, num_kv_heads, HEAD)
    elif layout == "flashinfer":
        shape = (num_blocks, 2, block_size, num_kv_heads, HEAD)
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return torch.full(shape, fill, dtype=torch.bfloat16, device=device)


def cache_views(kv: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), each [num_blocks, block_size, nkv, 64]: what qkv_front writes."""
    return (kv[0], kv[1]) if layout == "vllm" else (kv[:, 0], kv[:, 1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim, fp32 math, rounded once to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    token_block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Attention of each token over its request's cached keys at positions 0..positions[t].

    q [M, nq, 64]; caches [num_blocks, block_size, nkv, 64]; token_block_tables [M, max_blocks] (the block table
    of each token's request; entries past the request's length may be anything, they are masked).
    Returns [M, nq, 64] in q's dtype.
    """
    m, nq, d = q.shape
    bs, nkv = key_cache.shape[1], key_cache.shape[2]
    tables = token_block_tables.clamp_min(0)
    length = tables.shape[1] * bs
    k = key_cache[tables].reshape(m, length, nkv, d).transpose(1, 2)  # [M, nkv, L, 64]
    v = value_cache[tables].reshape(m, length, nkv, d).transpose(1, 2)
    keep = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [M, L]
    qg = q.reshape(m, nkv, nq // nkv, d)  # the q heads of one kv head are that head's "queries"
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=keep[:, None, None, :],
                                                           scale=d ** -0.5)
    return out.reshape(m, nq, d)


class DecoderAttentionBlock(torch.nn.Module):
    """Input RMSNorm -> musekern attention front -> paged attention -> sigmoid gate -> o_proj (one TP rank).

    `front`: the attention front, torch.ops.musekern.qkv_front by default (the cached kernels on a GPU, the
    reference on CPU); any function of the same signature (e.g. musekern.reference.qkv_front_reference) for A/B.
    """

    def __init__(self, weights: AttentionWeights, shard: ShardShape, *, num_blocks: int, block_size: int,
                 layout: str = "vllm", max_pos: int = 4096, rope_theta: float = 1e6, qk_eps: float = 1e-5,
                 rms_eps: float = 1e-5, front=None):
        super().__init__()
        self.nq, self.nkv = shard.num_q_heads, shard.num_kv_heads
        self.layout, self.qk_eps, self.rms_eps = layout, float(qk_eps), float(rms_eps)
        self.front = front if front is not None else torch.ops.musekern.qkv_front
        dev = weights.qkv.device
        self.register_buffer("norm_weight", weights.norm)
        self.register_buffer("qkv_weight", weights.qkv)
        self.register_buffer("o_weight", weights.o)
        self.register_buffer("cos_sin_cache", rope_cos_sin_table(max_pos, rope_theta, dev))
        self.register_buffer("kv", make_kv_cache(num_blocks, block_size, shard.num_kv_heads, layout, dev))

    @classmethod
    def for_config(cls, tp: int = 8, cfg=None, seed: int = 0, device=None, **cache) -> DecoderAttentionBlock:
        """A block for one rank of `cfg` (default: the bundled Muse Spark config) with random weights."""
        cfg = cfg or load_config()
        shard = cfg.shard(tp)
        w = random_weights(shard, cfg.hidden_size, seed, device)
        cache.setdefault("max_pos", min(cfg.max_position_embeddings, 4096))
        return cls(w, shard, rope_theta=cfg.rope_theta, qk_eps=cfg.rms_norm_eps, rms_eps=cfg.rms_norm_eps, **cache)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return cache_views(self.kv, self.layout)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, token_request: torch.Tensor) -> torch.Tensor:
        """hidden [M, 8192] bf16; positions, slot_mapping (-1: padding), token_request [M] int64;
        block_tables [requests, max_blocks] int64. Returns this rank's o_proj output [M, 8192] bf16."""
        m = hidden.shape[0]
        key_cache, value_cache = self.caches()
        x = rms_norm(hidden, self.norm_weight, self.rms_eps)
        y = self.front(x, self.qkv_weight, positions, self.cos_sin_cache, slot_mapping, key_cache, value_cache,
                       self.nkv, self.qk_eps)
        heads = y.view(m, -1, HEAD)
        q = heads[:, :self.nq]
        gate = heads[:, self.nq + 2 * self.nkv:]
        attn = paged_attention(q, key_cache, value_cache, block_tables[token_request], positions)
        gated = (attn.float() * torch.sigmoid(gate.float())).to(attn.dtype)
        return torch.nn.functional.linear(gated.reshape(m, self.nq * HEAD), self.o_weight)
