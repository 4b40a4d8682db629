"""Which graph of w8_all_m's measure() faults, and where (round 75 on an H100: "illegal memory access" at the first
synchronize after replaying TP1 M = 48's five graphs; TP1 M = 41 and every TP8 / TP4 M up to 4096 had run).

  seq SHARD MS      one process as w8_all_m runs it (w8_all_m.build: prepares and graphs of each M in its order), but
                    each graph replayed and synchronized once captured: the first to fault is named, in its history
  one SHARD M NAME  a fresh process: the same inputs and prepares, only graph NAME captured and replayed
  run SHARD MS      seq, then `one` of every graph of the last M, each in its own process (a fault is sticky); the
                    faulting ones again with the tuned GEMM's workspace allocation 32 MB larger (PAD_WS=1: the size
                    cuBLASLt is told stays the algorithm's) and under compute-sanitizer memcheck (one loop): the
                    kernel and the address

SHARD: 8, 4 or 1 (TP). GPU machine, cache carried: python3 bench/probes/all_m_replay.py run 1 41,48
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from bench.harness.timing import Graph
from bench.w8_all_m import SERIES, SHARDS, build
from bench.w8_bench import LAYERS
from musekern.config import load_config
from musekern.ops import qkv_front as front

NAMES = tuple(name for name, _, _ in SERIES)  # the five graphs


def replay(name: str, fs: list, loops: int) -> None:
    print(f"  {name}: eager + capture ...", end="", flush=True)
    gr = Graph(name, fs, loops, LAYERS)
    print(f" replay (loops {loops}) ...", end="", flush=True)
    gr.replay()
    gr.replay()
    torch.cuda.synchronize()
    print(" ok", flush=True)


def graphs(n: int, nkv: int, m: int, make) -> None:
    """w8_all_m.build's graphs of one M, each given to make(name, closures, loops) (LOOPS=k: k loops a replay)."""
    model = load_config()
    over = int(os.environ.get("LOOPS", "0"))
    build(n, nkv, m, model.rms_norm_eps, model.rope_theta, lambda name, fs, loops: make(name, fs, over or loops))


def shard(tp: str) -> tuple[int, int]:
    return {8: SHARDS[0], 4: SHARDS[1], 1: SHARDS[2]}[int(tp)]


def main() -> int:
    mode, tp, ms = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    n, nkv = shard(tp)
    torch.zeros(1, device="cuda")
    if mode == "seq":
        for m in ms:
            print(f"TP{tp} M={m} path {'front' if front._fused(n, m, 0, 'fp8_e4m3') else 'gemm'}", flush=True)
            graphs(n, nkv, m, replay)
            torch.cuda.empty_cache()
        return 0
    if mode == "one":
        kept = []
        graphs(n, nkv, ms[0], lambda name, fs, loops: kept.append((name, fs, loops)) if name == sys.argv[4] else None)
        (name, fs, lp), = kept
        from musekern.gemm import tune
        key = next((k for k in tune._RUNS if k[:2] == (n, ms[0])), None)
        if key and os.environ.get("PAD_WS"):
            tune._RUNS[key] = (tune._RUNS[key][0], tune._RUNS[key][1] + (32 << 20))
        picks = [(c.chosen, c.us.get(c.chosen)) for c in tune.choices() if (c.n, c.m) == (n, ms[0])]
        print(f"TP{tp} M={ms[0]} alone (tuned: {picks}, PAD_WS={os.environ.get('PAD_WS', '')}):", flush=True)
        replay(name, fs, lp)
        return 0
    assert mode == "run"
    me = [sys.executable, __file__]
    r = subprocess.run(me + ["seq", tp, sys.argv[3]], capture_output=True, text=True, timeout=240)
    print(r.stdout[-3000:], "rc", r.returncode, r.stderr.strip().splitlines()[-1:] if r.returncode else "")
    bad = []
    for name in NAMES:
        r = subprocess.run(me + ["one", tp, str(ms[-1]), name], capture_output=True, text=True, timeout=120)
        print("\n".join(r.stdout.strip().splitlines()[-2:]), "rc", r.returncode, r.stderr.strip().splitlines()[-1:]
              if r.returncode else "", flush=True)
        if r.returncode:
            bad.append(name)
    for name in bad:
        r = subprocess.run(me + ["one", tp, str(ms[-1]), name], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PAD_WS="1"))
        print("\n".join(r.stdout.strip().splitlines()[-2:]), "rc", r.returncode, flush=True)
    san = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "3", "--report-api-errors", "no"] + me
    for args in [["one", tp, str(ms[-1]), name] for name in bad[:2]] or [["seq", tp, sys.argv[3]]]:
        r = subprocess.run(san + args, capture_output=True, text=True, timeout=200, env=dict(os.environ, LOOPS="1"))
        lines = [s for s in r.stdout.splitlines() if s.startswith("=========") or s.startswith("  ")]
        print(f"memcheck {' '.join(args)}:", "\n".join(lines[:30]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
