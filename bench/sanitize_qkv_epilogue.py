#!/usr/bin/env python3
"""Eager launches of every qkv_epilogue build with hostile inputs, for compute-sanitizer: every buffer allocated to
its exact size (y's last row ends the allocation, also with strided rows; positions, slots, cos|sin and both caches
exact), padding slots (-1), a slot past the end of the cache, the last slot, positions past the table and negative,
both cache layouts, bf16 and FP8 (uint8 e4m3) caches (every FP8 build, a scale tensor and a float scale), partial
head groups (TP8's 18 heads at 4 and 8 heads a thread, N = 256's 3 heads < 4), M = 1, 17 and 300. Exit 0 if every
launch ran.

  compute-sanitizer --tool memcheck python3 bench/sanitize_qkv_epilogue.py
"""
import sys

import torch

from musekern.kernels.qkv_epilogue.variant import all_builds
from musekern.ops import qkv_epilogue as op

HD = 64
SHAPES = [(2176, 1), (17408, 8), (256, 1), (1280, 2)]  # (N, nkv): TP8, TP1, the smallest layout, nq = 4 nkv


def exact_y(m: int, n: int, pad: int) -> torch.Tensor:
    """y [m, n] with row stride n + pad whose last row ends exactly at the end of its allocation."""
    flat = torch.randn((m - 1) * (n + pad) + n, device="cuda").to(torch.bfloat16)
    return torch.as_strided(flat, (m, n), (n + pad, 1))


def caches(nb: int, bs: int, nkv: int, layout: str, dtype=torch.bfloat16):
    if layout == "vllm":
        kv = torch.zeros(2, nb, bs, nkv, HD, device="cuda", dtype=dtype)
        return kv[0], kv[1]
    kv = torch.zeros(nb, 2, bs, nkv, HD, device="cuda", dtype=dtype)
    return kv[:, 0], kv[:, 1]


def main() -> int:
    torch.manual_seed(0)
    max_pos, bs = 96, 16
    cs = torch.randn(max_pos, HD, device="cuda")
    launches = 0
    for i, (n, nkv) in enumerate(SHAPES):
        for m in (1, 17, 300):
            nb = (m + bs - 1) // bs
            pos = torch.randint(0, max_pos, (m,), device="cuda")
            pos[0] = max_pos + 1000
            slots = torch.randperm(nb * bs, device="cuda")[:m]
            if m > 1:
                pos[1] = -5
                slots[slots == nb * bs - 1] = -1
                slots[1] = nb * bs - 1  # the last slot
                slots[-1] = nb * bs + 3  # past the end
                slots[::4] = -1
            for layout in ("vllm", "flashinfer"):
                kc, vc = caches(nb, bs, nkv, layout)
                y = exact_y(m, n, 64 if layout == "flashinfer" else 0)
                op.qkv_epilogue(y, pos, cs, slots, kc, vc, nkv, 1e-5)  # the checked call: the planned build
                launches += 1
                for build in all_builds():
                    op.launch(y, pos, cs, slots, kc, vc, nkv, 1e-5, variant=build)
                    launches += 1
                k8, v8 = caches(nb, bs, nkv, layout, torch.uint8)  # FP8: the scale read on the device, and a float
                ks = torch.tensor(0.05, device="cuda")
                op.qkv_epilogue(y, pos, cs, slots, k8, v8, nkv, 1e-5, k_scale=ks, v_scale=0.03)
                launches += 1
                for build in all_builds("fp8_e4m3"):
                    op.launch(y, pos, cs, slots, k8, v8, nkv, 1e-5, variant=build, k_scale=ks, v_scale=0.03)
                    launches += 1
        torch.cuda.synchronize()
        print(f"sanitize: shape {i + 1}/{len(SHAPES)} N={n} done", file=sys.stderr)
    print(f"sanitize: {launches} launches ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
