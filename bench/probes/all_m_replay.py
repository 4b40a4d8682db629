"""Which graph of w8_all_m's measure() faults, and where (round 75 on an H100: "illegal memory access" at the first
synchronize after replaying TP1 M = 48's five graphs; TP1 M = 41 and every TP8 / TP4 M up to 4096 had run).

  seq SHARD MS      one process as w8_all_m runs it (prepare, the five graphs of each M in order), but each graph
                    replayed and synchronized alone: the first to fault is named, in its history
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

from bench.harness.timing import Graph, loops_for
from bench.w8_all_m import SHARDS
from bench.w8_bench import LAYERS, add_op_graphs, add_scaled_mm, layer_inputs
from musekern.config import load_config
from musekern.model import HIDDEN
from musekern.ops import qkv_front as front

NAMES = ("bf16", "fp8_channel", "fp8_block", "mm", "scaled_mm")


def closures(n: int, nkv: int, m: int, only: str | None, loops: int | None):
    """w8_all_m.measure's graphs as (name, closures, loops), in its order; `only`: that one graph's."""
    model = load_config()
    eps = model.rms_norm_eps
    g, cs, pos, x, kc, vc, slots, o, w8, wb = layer_inputs(n, nkv, m, model.rope_theta, 7000)
    seq_s = LAYERS * max(2 * n * HIDDEN / 3e12, 2 * m * n * HIDDEN / 600e12)
    out = []

    def add(name, call):
        out.append((name, [(lambda j=j: call(j)) for j in range(LAYERS)], loops or loops_for(seq_s)))

    add_op_graphs(add, n, nkv, m, g, lambda j: front.launch(x, wb[j], pos, cs, slots, kc, vc, nkv, eps, out=o[j]),
                  lambda j, sc: front.launch(x, w8[j], pos, cs, slots, kc, vc, nkv, eps, out=o[j], weight_scale=sc))
    add("mm", lambda j: torch.mm(x, wb[j].T, out=o[j]))
    add_scaled_mm(add, x, w8, o, g)
    keep = (g, cs, pos, x, kc, vc, slots, o, w8, wb)  # the tensors the closures name live as long as the graphs
    return [c for c in out if only in (None, c[0])], keep


def replay(name: str, fs: list, loops: int) -> None:
    print(f"  {name}: eager + capture ...", end="", flush=True)
    gr = Graph(name, fs, loops, LAYERS)
    print(f" replay (loops {loops}) ...", end="", flush=True)
    gr.replay()
    gr.replay()
    torch.cuda.synchronize()
    print(" ok", flush=True)


def shard(tp: str) -> tuple[int, int]:
    return {8: SHARDS[0], 4: SHARDS[1], 1: SHARDS[2]}[int(tp)]


def main() -> int:
    mode, tp, ms = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    n, nkv = shard(tp)
    torch.zeros(1, device="cuda")
    if mode == "seq":
        for m in ms:
            print(f"TP{tp} M={m} path {'front' if front._fused(n, m, 0, 'fp8_e4m3') else 'gemm'}", flush=True)
            cs, keep = closures(n, nkv, m, None, int(os.environ.get("LOOPS", "0")) or None)
            for name, fs, loops in cs:
                replay(name, fs, loops)
            del cs, keep
            torch.cuda.empty_cache()
        return 0
    if mode == "one":
        loops = int(os.environ.get("LOOPS", "0")) or None
        cs, keep = closures(n, nkv, ms[0], sys.argv[4], loops)
        (name, fs, lp), = cs
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
