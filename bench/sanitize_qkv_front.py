#!/usr/bin/env python3
"""One launch of every default-model qkv_front variant (and qk_norm) with hostile inputs, for compute-sanitizer:
padding slots (-1), a slot past the end of the cache, positions past the end of the table and negative, at the
smallest and the largest M each planned front build serves (`planned_ms`: every build per N, its most padded and its
fullest token tiles) and M = 100 (torch.mm + the fused epilogue everywhere), each into bf16 caches and into FP8 (uint8
e4m3) caches with a scale tensor and a float scale (the --kv-cache-dtype fp8 builds), FlashInfer's strided layout,
and at M <= 16 with e4m3 weights (channel scales, bf16 caches; block scales, FP8 caches); at
M = 100 also every cuBLASLt algorithm the GEMM path may choose (`gemm.tune`: each candidate launched once through
gemm/cublaslt.py, so the binding's layouts and workspace are checked). Exit 0 if every launch ran.
`--fused-only`: only the M the fused front serves (racecheck: on the GEMM path it reports hazards inside cuBLAS's own
nvjet kernels, which are not musekern's; bench/sanitize_qkv_epilogue.py checks the epilogue). `--w8a8-only`: only the
e4m3-weight launches of the W8A8 ("wg") builds (TP8's one-tile e4m3 build; a design round's quick check).

  compute-sanitizer --tool memcheck python3 bench/sanitize_qkv_front.py
"""
import sys

import torch

import musekern
from musekern.config import load_config
from musekern.targets import local_target

HIDDEN, HD = 8192, 64


def planned_ms(n: int, num_kv_heads: int, target) -> list:
    """The smallest and the largest M of every front build the plan takes for N (M up to FRONT_MAX_TOKENS)."""
    from musekern.kernels.qkv_front.rules import served_tokens
    from musekern.kernels.qkv_front.variant import FRONT_MAX_TOKENS

    builds = served_tokens(n, num_kv_heads, target, FRONT_MAX_TOKENS)
    return sorted({m for ms in builds.values() for m in (ms[0], ms[-1])})


def lt_candidates(w, x) -> int:
    """Every algorithm cuBLASLt offers for this (N, M), launched once (the GEMM path's binding under the sanitizer)."""
    from musekern.gemm import cublaslt
    from musekern.runtime.loader import current_stream_getter

    dev = torch.cuda.current_device()
    mat = cublaslt.Matmul(cublaslt.library(), w.shape[0], x.shape[0], dev)
    y = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16)
    cands = mat.candidates()
    for c in cands:
        ws = torch.empty(max(c.workspace, 1), device="cuda", dtype=torch.uint8)
        mat.launcher(c)(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), current_stream_getter()(dev))
    torch.cuda.synchronize()
    return len(cands)


def main() -> int:
    from musekern.ops.qkv_front import _fused, _variant

    fused_only = "--fused-only" in sys.argv[1:]
    w8a8_only = "--w8a8-only" in sys.argv[1:]
    dev = torch.cuda.current_device()
    model = load_config()
    torch.manual_seed(0)
    max_pos, nb, bs = 256, 8, 16
    cs = torch.randn(max_pos, HD, device="cuda")
    n_launch = 0
    target = local_target()
    for shard in model.shards():
        w = (torch.randn(shard.n, HIDDEN, device="cuda") / 90).to(torch.bfloat16)
        for m in planned_ms(shard.n, shard.num_kv_heads, target) + [100]:
            if fused_only and not _fused(shard.n, m, dev):
                continue
            fp8_front = _fused(shard.n, m, dev, "fp8_e4m3")
            if w8a8_only and not (fp8_front and _variant(shard.n, m, shard.num_kv_heads, dev, "bf16", "fp8_e4m3",
                                                  "channel").warp_split == "wg"):
                continue
            x = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
            pos = torch.randint(0, max_pos, (m,), device="cuda")
            pos[0] = max_pos + 1000
            if m > 1:
                pos[1] = -5
            slots = torch.randperm(nb * bs, device="cuda")[:m]
            slots[-1] = nb * bs + 3 if m > 1 else -1
            if m > 2:
                slots[0] = -1
            kv = torch.zeros(nb, 2, bs, shard.num_kv_heads, HD, device="cuda", dtype=torch.bfloat16)
            kv8 = torch.zeros(nb, 2, bs, shard.num_kv_heads, HD, device="cuda", dtype=torch.uint8)
            if not w8a8_only:
                musekern.qkv_front(x, w, pos, cs, slots, kv[:, 0], kv[:, 1], shard.num_kv_heads, 1e-5)
                musekern.qkv_front(x, w, pos, cs, slots, kv8[:, 0], kv8[:, 1], shard.num_kv_heads, 1e-5,
                                   k_scale=torch.tensor(0.05, device="cuda"), v_scale=0.03)
                n_launch += 2
            # the e4m3-weight builds where the front serves M (issue 30, both scale kinds; the second with FP8 caches)
            if fp8_front:
                w8 = (w.float() * 90).clamp(-448, 448).to(torch.float8_e4m3fn)
                musekern.qkv_front(x, w8, pos, cs, slots, kv[:, 0], kv[:, 1], shard.num_kv_heads, 1e-5,
                                   weight_scale=torch.full((shard.n,), 1 / 90, device="cuda"))
                musekern.qkv_front(x, w8, pos, cs, slots, kv8[:, 0], kv8[:, 1], shard.num_kv_heads, 1e-5,
                                   k_scale=0.05, v_scale=0.03,
                                   weight_scale=torch.full((shard.n // HD, HIDDEN // 128), 1 / 90, device="cuda"))
                n_launch += 2
            if m == 100:
                n_launch += lt_candidates(w, x)
        torch.cuda.synchronize()
    for hd in () if w8a8_only else (64, 128):
        q = torch.randn(33, 4 * hd + 24, device="cuda").to(torch.bfloat16)[:, : 4 * hd]
        musekern.qk_norm(q, hd, scale=0.5)
        n_launch += 1
    torch.cuda.synchronize()
    print(f"sanitize: {n_launch} launches ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
