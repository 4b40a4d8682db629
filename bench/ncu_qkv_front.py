#!/usr/bin/env python3
"""A few eager launches of planned qkv_front variants, for Nsight Compute (stall reasons, DRAM throughput).

  ncu --clock-control none --kernel-name regex:qkv_front --launch-skip 3 --launch-count 2 \\
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --csv \\
      python3 bench/ncu_qkv_front.py 2176 1 16      (N, then the M values; 3 warm-up launches each)

`--scale channel|block` launches the e4m3-weight builds instead (bench/w8_bench.py's weights and multipliers).
"""
import argparse
import sys

import torch

from musekern.config import load_config
from musekern.ops.qkv_front import qkv_front


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int)
    ap.add_argument("ms", type=int, nargs="+")
    ap.add_argument("--scale", choices=("channel", "block"), help="e4m3 weights with this scale kind")
    a = ap.parse_args(argv)
    shard = next(s for s in load_config().shards() if s.n == a.n)
    ws = None
    if a.scale:
        from bench.w8_bench import e4m3_weight, scales
        g = torch.Generator(device="cuda").manual_seed(5)
        w, ws = e4m3_weight(a.n, g), scales(a.n, a.scale, g)
    else:
        w = (torch.randn(a.n, 8192, device="cuda") / 90).to(torch.bfloat16)
    cs = torch.randn(4096, 64, device="cuda")
    kv = torch.zeros(2, 64, 16, shard.num_kv_heads, 64, dtype=torch.bfloat16, device="cuda")
    for m in a.ms:
        x = torch.randn(m, 8192, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 4096, (m,), device="cuda")
        slots = torch.randperm(1024, device="cuda")[:m]
        for _ in range(5):  # ncu: --launch-skip 3 --launch-count 2 per M
            qkv_front(x, w, pos, cs, slots, kv[0], kv[1], shard.num_kv_heads, 1e-5, weight_scale=ws)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
