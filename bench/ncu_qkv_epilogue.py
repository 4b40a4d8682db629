#!/usr/bin/env python3
"""A few eager launches of the planned qkv_epilogue build and of a device copy of as many bytes, for Nsight Compute
(DRAM and L2 throughput, stall reasons): what keeps the epilogue below the copy at large M.

  ncu --clock-control none --kernel-name regex:"qkv_epilogue|vectorized_elementwise" --launch-count 24 \\
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --csv \\
      python3 bench/ncu_qkv_epilogue.py 17408 16384 [--variants "LABEL;..."]     (N, then the M values; 3 launches of
      each kernel per M, after the bf16 conversion of y, an elementwise kernel too; --variants: 3 launches of each of
      these qkv_epilogue builds too, after the planned one's: raise --launch-count to 40; --fp8: 3 launches of the
      planned FP8-KV build too, e4m3 caches and device scales, after the bf16 one's)
"""
import sys

import torch

from musekern.config import load_config
from musekern.kernels.qkv_epilogue.variant import epilogue_bytes
from musekern.ops.qkv_epilogue import launch, qkv_epilogue
from musekern.plan import variant_from_label
from musekern.reference import rope_cos_sin_table


def main(argv) -> int:
    builds = []
    fp8 = "--fp8" in argv
    argv = [a for a in argv if a != "--fp8"]
    if "--variants" in argv:
        i = argv.index("--variants")
        builds = [variant_from_label(lbl) for lbl in argv[i + 1].split(";")]
        argv = argv[:i] + argv[i + 2:]
    n, ms = int(argv[0]), [int(a) for a in argv[1:]]
    model = load_config()
    shard = next(s for s in model.shards() if s.n == n)
    nkv = shard.num_kv_heads
    cs = rope_cos_sin_table(4096, model.rope_theta, "cuda")
    for m in ms:
        y = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 4096, (m,), device="cuda")
        blocks = -(-m // 16)
        slots = torch.randperm(blocks * 16, device="cuda")[:m]
        kv = torch.zeros(2, blocks, 16, nkv, 64, dtype=torch.bfloat16, device="cuda")
        half = epilogue_bytes(m, n, nkv) // 4  # bf16 elements read (= written) by a copy of the epilogue's bytes
        src = torch.empty(half, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            qkv_epilogue(y, pos, cs, slots, kv[0], kv[1], nkv, model.rms_norm_eps)
        if fp8:
            kv8 = torch.zeros(2, blocks, 16, nkv, 64, dtype=torch.uint8, device="cuda")
            scales = torch.tensor([0.0371, 0.0517], device="cuda")  # not powers of two: the quotient path
            for _ in range(3):
                qkv_epilogue(y, pos, cs, slots, kv8[0], kv8[1], nkv, model.rms_norm_eps, k_scale=scales[0],
                             v_scale=scales[1])
        for v in builds:
            for _ in range(3):
                launch(y, pos, cs, slots, kv[0], kv[1], nkv, model.rms_norm_eps, variant=v)
        for _ in range(3):  # an elementwise kernel (copy_ of contiguous tensors is a cudaMemcpy, no kernel to profile)
            torch.mul(src, 1.0, out=dst)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
