#!/usr/bin/env python3
"""A few eager launches of planned qkv_front variants, for Nsight Compute (stall reasons, DRAM throughput).

  ncu --clock-control none --kernel-name regex:qkv_front --launch-skip 3 --launch-count 2 \\
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --csv \\
      python3 bench/ncu_qkv_front.py 2176 1 16      (N, then the M values; 3 warm-up launches each)
"""
import sys

import torch

from musekern.config import load_config
from musekern.ops.qkv_front import qkv_front


def main(argv) -> int:
    n, ms = int(argv[0]), [int(a) for a in argv[1:]]
    shard = next(s for s in load_config().shards() if s.n == n)
    w = (torch.randn(n, 8192, device="cuda") / 90).to(torch.bfloat16)
    cs = torch.randn(4096, 64, device="cuda")
    kv = torch.zeros(2, 64, 16, shard.num_kv_heads, 64, dtype=torch.bfloat16, device="cuda")
    for m in ms:
        x = torch.randn(m, 8192, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 4096, (m,), device="cuda")
        slots = torch.randperm(1024, device="cuda")[:m]
        for _ in range(5):  # ncu: --launch-skip 3 --launch-count 2 per M
            qkv_front(x, w, pos, cs, slots, kv[0], kv[1], shard.num_kv_heads, 1e-5)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
