#!/usr/bin/env python3
"""How long `musekern.prepare_ops` takes an engine's capture sizes, in a fresh process, without and with the cache's
GEMM tuning record (gemm/records.py): per shard, the records cleared, then one process (`cold`: every GEMM-path M
timed and recorded) and a second (`recorded`: each checked, not timed), both from a warm kernel cache and after torch
and CUDA are up. The capture sizes are vLLM's defaults up to 512 (1, 2, 4, 8 ... 248 every 8, 256 ... 512 every 16).

  python3 bench/prepare_time.py [--out FILE]        (on the GPU machine, the carried cache)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from issue13_table import write_results  # noqa: E402

SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
SHARDS = ((2176, 1), (4352, 2), (17408, 8))

CHILD = r"""
import json, sys, time, torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
import musekern
from musekern.gemm import tune as gemm
n, nkv, sizes = json.loads(sys.argv[1])
t0 = time.perf_counter()
musekern.prepare_ops(n, sizes, num_kv_heads=nkv)
dt = time.perf_counter() - t0
cs = gemm.choices()
print(json.dumps({"s": round(dt, 3), "gemm_shapes": len(cs), "recorded": sum(c.recorded for c in cs),
                  "lt_picks": sum(c.chosen != "mm" for c in cs)}))
"""


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from musekern.gemm import records
    from musekern.runtime.loader import open_cache

    rows = []
    for n, nkv in SHARDS:
        records.clear(open_cache())
        row = {"N": n, "sizes": len(SIZES)}
        for run in ("cold", "recorded"):
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([n, nkv, SIZES])], capture_output=True,
                                 text=True, timeout=600)
            if out.returncode:
                raise SystemExit(f"prepare failed ({run}, N={n}): {out.stderr[-2000:]}")
            row[run] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"prepare_ops of {len(SIZES)} capture sizes in a fresh process (s): cold (GEMM path timed) | recorded")
    for r in rows:
        c, w = r["cold"], r["recorded"]
        print(f"N={r['N']:>6}: {c['s']:7.2f} | {w['s']:6.2f}   GEMM-path shapes {c['gemm_shapes']}, "
              f"{w['recorded']} from the record, {c['lt_picks']} cuBLASLt picks")
    write_results(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
