"""The model's shape constants, each defined once (pure: every layer may import this).

The kernels are built for Muse Spark's attention front: a hidden size of 8192 (the projection's K) and heads of 64
columns. config.py rejects a model of other shapes; the kernels, the op checks, the GEMM binding and the reference
take these numbers from here.
"""
from __future__ import annotations

HIDDEN = 8192  # K of the q|k|v|gate projection: Muse Spark's hidden size
HEAD_DIM = 64  # columns of one attention head (q, k, v and gate alike): 32 RoPE pairs, the caches' last dim
# The largest M one fused-front build serves (8 token tiles of 8): the plan builds the front for M <=
# max_decode_tokens where the planner's rule picks it; every other M takes cuBLAS + the fused epilogue.
FRONT_MAX_TOKENS = 64


def supports_shape(n: int, num_kv_heads: int) -> bool:
    """Can the kernels serve a weight of N rows with these KV heads (q|k|v|gate, 64 columns a head)?"""
    if n <= 0 or n % HEAD_DIM or num_kv_heads < 1:
        return False
    rest = n // HEAD_DIM - 2 * num_kv_heads  # q + gate heads
    return rest >= 2 and rest % 2 == 0 and (rest // 2) % num_kv_heads == 0
