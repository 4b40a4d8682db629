"""Plain-torch references (CPU or GPU): what the kernels must equal."""
from __future__ import annotations

import math

import torch

from .kernels.x_quant.variant import XQ_GROUP as FP8_K_GROUP
from .kernels.x_quant.variant import XQ_GROUP_EPS as FP8_GROUP_EPS
from .kv_cache import E4M3_MAX
from .model import HEAD_DIM


def qk_norm_reference(x: torch.Tensor, head_dim: int, eps: float = 1e-5, scale: float = 1.0) -> torch.Tensor:
    """Unweighted RMS norm over each head_dim group, times `scale`; fp32 math, one rounding at the end."""
    m, n = x.shape
    xf = x.float().reshape(m, n // head_dim, head_dim)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale
    return y.reshape(m, n).to(x.dtype)


# ---------------------------------------------------------------- qkv_front (seed 000)


def rope_cos_sin_table(max_pos: int, theta: float, device=None) -> torch.Tensor:
    """The cos_sin_cache qkv_front reads: float32 [max_pos, 64], row p = cos(p f_0..f_31) | sin(p f_0..f_31),
    f_i = theta^(-2i/64) (computed in float64, rounded once)."""
    inv = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float().to(device)


def fused_qknorm_rope_kv_insert(y_gemm_bf16: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                num_kv_heads: int, eps: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """The qkv_front epilogue on a bf16 GEMM result y [M, N] (columns q | k | v | gate, 64 a head).

    - q and k heads: unweighted RMS norm over the head's 64 values (fp32 math on the bf16 values),
      then interleaved RoPE: pair (2i, 2i+1) = (a, b) -> (a*c - b*s, a*s + b*c) with
      c, s = cos_sin_cache[p, i], cos_sin_cache[p, 32 + i] and p the token's position; fp32
      throughout, one rounding to bf16 at the store;
    - v and gate heads: unchanged;
    - k (normed, roped) and v of token t are written to key_cache / value_cache
      [num_blocks, block_size, num_kv_heads, 64] at block slot // block_size, offset
      slot % block_size, unless slot < 0 (padding) or slot >= num_blocks * block_size; to an FP8 cache
      (float8_e4m3fn, or uint8 holding e4m3 bytes) as `e4m3_rows(rows, k_scale)` / `e4m3_rows(rows, v_scale)`
      of those bf16 rows (vLLM's order: round to bf16, then quantize); a bf16 cache ignores the scales;
    Positions outside [0, max_pos) are clamped to [0, max_pos - 1] (the kernel does the same:
    it never reads cos|sin out of bounds). Returns a new tensor; the caches are written in place.
    Two tokens with the same valid slot in one call: which token's k / v that slot then holds is
    undefined (here per cache row, in torch's index_put_ order; the kernels per 16-byte piece); every
    other slot is exact. Engines never map two tokens of a step to one slot.
    Vectorized (no Python loop over tokens) and free of host syncs on GPU tensors (CUDA-graph capturable).
    """
    m, n = y_gemm_bf16.shape
    d = HEAD_DIM
    heads = n // d
    nkv = num_kv_heads
    nq = (heads - 2 * nkv) // 2
    y = y_gemm_bf16.to(torch.bfloat16).float().reshape(m, heads, d)
    out = y.clone()
    qk = y[:, :nq + nkv]
    qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)
    max_pos = cos_sin_cache.shape[0]
    pos = positions.to(device=cos_sin_cache.device, dtype=torch.long).clamp(0, max_pos - 1)
    cs = cos_sin_cache.float()[pos].to(y.device)  # [M, 64]
    c, s = cs[:, None, : d // 2], cs[:, None, d // 2:]
    a, b = qk[..., 0::2], qk[..., 1::2]
    roped = torch.stack((a * c - b * s, a * s + b * c), dim=-1).reshape(m, nq + nkv, d)
    out[:, :nq + nkv] = roped
    out = out.reshape(m, n).to(torch.bfloat16)
    heads_out = out.reshape(m, heads, d)
    k, v = heads_out[:, nq:nq + nkv], heads_out[:, nq + nkv:nq + 2 * nkv]
    insert_cache_rows(key_cache, slot_mapping, cache_rows(k, key_cache, k_scale))
    insert_cache_rows(value_cache, slot_mapping, cache_rows(v, value_cache, v_scale))
    return out


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # an FP8 cache: e4m3, or its bytes as vLLM allocates them


def e4m3_rows(rows_bf16: torch.Tensor, scale=None) -> torch.Tensor:
    """float8_e4m3fn of float(rows) / scale, rounded to nearest even and saturated to +-448 (PTX
    cvt.rn.satfinite.e4m3x2.f32; torch's own cast does not saturate: 480 and above become NaN, so clamp first).
    `scale`: None (1.0), a float, or a one-element float32 tensor; a true fp32 division, as vLLM's cache write."""
    x = rows_bf16.to(torch.bfloat16).float()
    if scale is not None:
        s = scale.to(device=x.device, dtype=torch.float32).reshape(()) if isinstance(scale, torch.Tensor) \
            else torch.tensor(float(scale), dtype=torch.float32, device=x.device)
        x = x / s
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def cache_rows(rows_bf16: torch.Tensor, cache: torch.Tensor, scale=None) -> torch.Tensor:
    """The rows as `cache` stores them: bf16 unchanged (the scale ignored), or their e4m3 bytes (in the cache's
    dtype: float8_e4m3fn or uint8)."""
    if cache.dtype not in FP8_CACHE_DTYPES:
        return rows_bf16
    q = e4m3_rows(rows_bf16, scale)
    return q.view(torch.uint8) if cache.dtype == torch.uint8 else q


def insert_cache_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[s // block_size, s % block_size] = rows[t] for every token t whose slot s = slot_mapping[t] is in
    [0, num_blocks * block_size); other tokens write nothing. One index_put_ of a data-independent shape (no
    host sync): a token with no valid slot repeats the write of the first token that has one (same slot, same
    bits), or, where no token has one, writes slot 0's own bits back to it."""
    m = rows.shape[0]
    if m == 0:
        return
    if cache.dtype == torch.float8_e4m3fn:  # moved as bytes (torch.where takes no float8)
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    nb, bs = cache.shape[0], cache.shape[1]
    slots = slot_mapping.to(device=cache.device, dtype=torch.long)
    valid = (slots >= 0) & (slots < nb * bs)
    first = torch.argmax(valid.to(torch.int32))  # the first valid token (0 if none is)
    src = torch.where(valid, torch.arange(m, device=cache.device), first)
    ok = valid[src]
    dst = torch.where(ok, slots[src], 0)
    blk, off = torch.div(dst, bs, rounding_mode="floor"), dst % bs
    new = rows.to(device=cache.device, dtype=cache.dtype)[src]
    cache[blk, off] = torch.where(ok[:, None, None], new, cache[blk, off])


def qkv_front_reference(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, num_kv_heads: int, eps: float,
                        out: torch.Tensor | None = None, k_scale=None, v_scale=None,
                        weight_scale=None) -> torch.Tensor:
    """y = fused_qknorm_rope_kv_insert(bf16(x @ W^T)) with an fp32-accumulated GEMM (CPU or GPU). W is `weight`
    (bf16), or an FP8 one (issue 30): float8_e4m3fn `weight` with its `weight_scale` in the canonical layout
    (musekern.weights.pack: float32 [N] per row or [N // 64, 64] per 64 rows x 128 K), W = its fp32 dequantization
    (`pack.dequantize_tensors`): x is not quantized, the exact product's reference."""
    if (weight.dtype == torch.float8_e4m3fn) != (weight_scale is not None):
        raise ValueError("qkv_front_reference: a weight_scale goes with a float8_e4m3fn weight, and only with one "
                         f"(weight {weight.dtype}, weight_scale {'given' if weight_scale is not None else 'None'})")
    if weight_scale is None:
        w = weight.float()
    else:
        from .weights.pack import dequantize_tensors

        w = dequantize_tensors(weight, weight_scale.to(weight.device))
    y_gemm = (x.float() @ w.t()).to(torch.bfloat16)
    y = fused_qknorm_rope_kv_insert(y_gemm, positions, cos_sin_cache, slot_mapping, key_cache, value_cache,
                                    num_kv_heads, eps, k_scale, v_scale)
    if out is not None:
        out.copy_(y)
        return out
    return y


# ---------------------------------------------------------------- FP8 weights (issue 30): the accuracy bound's two ends
# A kernel on an FP8 checkpoint is held to: its y's error against fp8_gemm_fp64 (the exact product with the dequantized
# weight) no larger than vllm_fp8_gemm's (vLLM's Hopper path on the same inputs). Both take the canonical layout of
# musekern.weights.pack (PackedWeight: e4m3 [N, 8192] + fp32 multipliers).
FP8_MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)  # vLLM's min_scaling_factor of a per-token x scale (csrc utils.cuh)
# FP8_GROUP_EPS: vLLM's floor on a 128-group's amax (per_token_group_quant_fp8); FP8_K_GROUP: columns of one x group
# / weight block in K (both the x_quant kernel's constants)


def bf16_step(v: float) -> float:
    """The gap between neighbouring bf16 values at |v| (2^(e - 7) for 2^e <= |v| < 2^(e + 1)): the size of a
    rounding flip, where two sums of the same products in another order round to the two sides of a boundary."""
    return math.ldexp(1.0, math.frexp(abs(v))[1] - 8)


def fp8_gemm_fp64(x: torch.Tensor, packed) -> torch.Tensor:
    """float64 [M, N]: x @ dequant(W)^T exactly (x bf16 or float; the products and sums in fp64)."""
    from .weights.pack import dequantize

    return x.double() @ dequantize(packed).double().t()


def _over_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax / 448 correctly rounded on every device (CUDA torch divides by a Python scalar as a multiply by its
    rounded reciprocal, off by an ulp for about half of all inputs; an fp64 quotient rounds once more exactly)."""
    return (amax.double() / E4M3_MAX).float()


def quantize_x_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token x quantization (dynamic_per_token_scaled_fp8_quant): s = max(amax / 448,
    FP8_MIN_SCALE) per row, q = e4m3(clamp(x / s, +-448)) (true divisions, round to nearest even).
    Returns (q [M, K], s [M, 1])."""
    xf = x.float()
    s = torch.clamp(_over_e4m3_max(xf.abs().amax(dim=-1, keepdim=True)), min=FP8_MIN_SCALE)
    return (xf / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def quantize_x_per_group(x: torch.Tensor, ue8m0: bool = False,
                         by_reciprocal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-token-group x quantization of block checkpoints (per_token_group_quant_fp8, groups of 128
    columns): s = max(amax, FP8_GROUP_EPS) / 448 per (row, group), rounded up to a power of two with ue8m0;
    q = e4m3(clamp(x / s)), or e4m3(clamp(x * fl(1 / s))) with by_reciprocal (the W8A8 front's: one correctly
    rounded reciprocal per group, a multiply per value). Returns (q [M, K], s [M, K / 128])."""
    xf = x.float()
    m, k = xf.shape
    g = xf.reshape(m, k // FP8_K_GROUP, FP8_K_GROUP)
    s = _over_e4m3_max(torch.clamp(g.abs().amax(dim=-1), min=FP8_GROUP_EPS))
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    v = g * torch.reciprocal(s)[..., None] if by_reciprocal else g / s[..., None]
    q = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(m, k)
    return q, s


def _group_scaled_sums(q: torch.Tensor, s: torch.Tensor, packed) -> torch.Tensor:
    """float32 [M, N]: sum over the 128-column blocks kb of (q[:, kb] . w[:, kb]) * s[:, kb] * s_w (s_w per row, or
    per (head, kb) for block weights), in fp64, rounded once."""
    m, n, kb = q.shape[0], packed.n, q.shape[1] // FP8_K_GROUP
    parts = torch.einsum("mkc,nkc->mnk", q.double().reshape(m, kb, FP8_K_GROUP),
                         packed.weight.double().reshape(n, kb, FP8_K_GROUP))
    sw = packed.weight_scale.double()
    sw = sw.repeat_interleave(HEAD_DIM, 0)[None] if packed.fmt.granularity == "block" else sw[None, :, None]
    return (parts * s.double()[:, None, :] * sw).sum(-1).float()


def vllm_fp8_gemm(x: torch.Tensor, packed) -> torch.Tensor:
    """float32 [M, N]: what vLLM's Hopper W8A8 path computes before its bf16 cast, in exact arithmetic (fp64 sums,
    one fp32 rounding at the end: the hardware's fast accumulation may only add error). Per-channel and per-tensor
    weights: x per token, y = (q_x @ q_w^T) * s_x[m] * s_w[n] (cutlass_scaled_mm's ScaledEpilogue). Block weights: x
    per 128-group (ue8m0 where the weights are), each 128-K block's product scaled by s_x[m, kb] * s_w[n, kb]
    (w8a8_block_fp8_matmul); the canonical layout's [N / 64, 64] block scales are the checkpoint's 128-row ones.
    Per-tensor checkpoints: the per-row scales as packed (vLLM first requantizes a fused q|k|v to the largest shard
    scale, one more rounding: this bound is the stricter one)."""
    if packed.fmt.granularity == "block":
        return _group_scaled_sums(*quantize_x_per_group(x, packed.fmt.ue8m0), packed)
    q, s = quantize_x_per_token(x)
    return ((q.double() @ packed.weight.double().t()) * s.double() * packed.weight_scale.double()[None, :]).float()


def w8a8_x(x: torch.Tensor, ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x as musekern's W8A8 front builds (warp_split "wg") read it, whatever the weights' granularity: per (token,
    128-column group), vLLM's group scale; each value times the scale's reciprocal where the build quantizes x itself
    (fp8.group_scale, fp8.rcp_rn), vLLM's quotient where x_quant did it ahead (`ahead`: x_dtype fp8_e4m3)."""
    return quantize_x_per_group(x, by_reciprocal=not ahead)


def w8a8_gemm(x: torch.Tensor, packed, ahead: bool = False) -> torch.Tensor:
    """float32 [M, N]: the W8A8 front builds' arithmetic in exact sums (w8a8_x's x, each k-tile's product times its
    x scale and the weight scale). For block weights it is vLLM's (up to the x division unless `ahead`); for per-row
    weights its x groups are finer than vLLM's per-token scale: another rounding of x, no larger on average
    (test_reference)."""
    return _group_scaled_sums(*w8a8_x(x, ahead), packed)


def w8a8_x_dequantized(x: torch.Tensor, ahead: bool = False) -> torch.Tensor:
    """float64 [M, K]: w8a8_x's bytes times their scales, exactly (the W8A8 builds' own fp64 truth starts here)."""
    q, s = w8a8_x(x, ahead)
    m, k = q.shape
    return (q.double().reshape(m, k // FP8_K_GROUP, FP8_K_GROUP) * s.double()[..., None]).reshape(m, k)
