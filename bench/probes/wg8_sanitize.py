#!/usr/bin/env python3
"""Probe (issue 30): the W8A8 ("wg") e4m3 front builds alone under compute-sanitizer (bench/sanitize_qkv_front.py runs
every front build; this one only TP8's e4m3 builds, x quantized ahead, at M = 1, 4, 8, 9, 16, with its hostile
inputs: padding and out-of-range slots, positions past the table and negative; channel scales into bf16 caches, block
scales into FP8 caches). Exit 0 if every launch ran.

  compute-sanitizer --tool racecheck python3 bench/probes/wg8_sanitize.py
"""
import sys

import torch

import musekern
from musekern.config import load_config
from musekern.ops.qkv_front import _variant

HIDDEN, HD = 8192, 64


def main() -> int:
    shard = load_config().shard(8)
    torch.manual_seed(0)
    max_pos, nb, bs = 256, 8, 16
    cs = torch.randn(max_pos, HD, device="cuda")
    w8 = torch.randn(shard.n, HIDDEN, device="cuda").clamp(-448, 448).to(torch.float8_e4m3fn)
    n = 0
    for m in (1, 4, 8, 9, 16):
        assert _variant(shard.n, m, shard.num_kv_heads, 0, "bf16", "fp8_e4m3", "channel").warp_split == "wg"
        x = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, max_pos, (m,), device="cuda")
        pos[0] = max_pos + 1000
        if m > 1:
            pos[1] = -5
        slots = torch.randperm(nb * bs, device="cuda")[:m]
        slots[-1] = nb * bs + 3 if m > 1 else -1
        kv = torch.zeros(nb, 2, bs, shard.num_kv_heads, HD, device="cuda", dtype=torch.bfloat16)
        kv8 = torch.zeros(nb, 2, bs, shard.num_kv_heads, HD, device="cuda", dtype=torch.uint8)
        musekern.qkv_front(x, w8, pos, cs, slots, kv[:, 0], kv[:, 1], shard.num_kv_heads, 1e-5,
                           weight_scale=torch.full((shard.n,), 1 / 90, device="cuda"))
        musekern.qkv_front(x, w8, pos, cs, slots, kv8[:, 0], kv8[:, 1], shard.num_kv_heads, 1e-5,
                           k_scale=0.05, v_scale=0.03,
                           weight_scale=torch.full((shard.n // HD, HIDDEN // 128), 1 / 90, device="cuda"))
        n += 2
    torch.cuda.synchronize()
    print(f"wg8_sanitize: {n} launches ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
