#!/usr/bin/env python3
"""Issue 13's opening table, re-measured as it was taken: `musekern.qkv_front_auto`, eager, host-timed, beside
`torch.mm` alone, and whether one call captures in a CUDA graph, at the issue's (N, M) and the tile / path edges.

Per (N, M) (N a shard of the bundled config, its KV heads): host time per call, synchronized after every call
(`sync`: what one eager call costs the host end to end) and over 50 calls queued back to back (`queued`: the
slower of the host's enqueue and the GPU); the same for `torch.mm(x, w.t(), out=y)`; the eager calls run under
torch.cuda.set_sync_debug_mode("error") (a host sync raises); `capture` = a CUDA graph of one call after
`musekern.prepare_ops` replays with new inputs copied in and equals an eager call bit for bit ("ok"), or the error.
One weight (no rotation: the issue's table had none). Prints a table; --out writes JSON (commit, device).

  python3 bench/issue13_table.py [--out FILE]        (on the GPU machine, the carried cache)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import musekern
from bench.harness.report import HIDDEN, commit_info
from musekern.config import load_config
from musekern.reference import rope_cos_sin_table

BLOCK_SIZE = 16
CASES = ((2176, 16), (2176, 17), (2176, 64), (2176, 65), (2176, 2048), (4352, 64), (4352, 65), (17408, 16),
         (17408, 17), (17408, 2048))  # the rows, then the path edges at TP8 / TP4 / TP1


def _inputs(n, nkv, m, g):
    blocks = -(-m // BLOCK_SIZE) + 1
    kv = torch.zeros(2, blocks, BLOCK_SIZE, nkv, 64, dtype=torch.bfloat16, device="cuda")
    return dict(x=torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16),
                weight=(torch.randn(n, HIDDEN, device="cuda", generator=g) / 90).to(torch.bfloat16),
                positions=torch.randint(0, 4096, (m,), device="cuda", generator=g),
                cos_sin_cache=rope_cos_sin_table(4096, 1e6, "cuda"),
                slot_mapping=torch.randperm(blocks * BLOCK_SIZE, device="cuda", generator=g)[:m],
                key_cache=kv[0], value_cache=kv[1], num_kv_heads=nkv, eps=1e-6)


def _host_us(f, calls, sync_each):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(ts)


def _capture(p, n, m, g):
    """A graph of one call (outputs and caches poisoned first), replayed with new x, positions and slots copied in:
    'ok' when it equals an eager call on the same inputs bit for bit, else the reason."""
    try:  # (main loaded the builds this call shape takes)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        musekern.qkv_front_auto(**p, out=out)  # warm (cuBLAS handle, launchers) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            musekern.qkv_front_auto(**p, out=out)
        fresh = _inputs(n, p["num_kv_heads"], m, g)
        for k in ("x", "positions", "slot_mapping"):
            p[k].copy_(fresh[k])
        out.fill_(float("nan"))
        p["key_cache"].fill_(-7.0)
        p["value_cache"].fill_(-7.0)
        graph.replay()
        torch.cuda.synchronize()
        got = (out.clone(), p["key_cache"].clone(), p["value_cache"].clone())
        p["key_cache"].fill_(-7.0)
        p["value_cache"].fill_(-7.0)
        want = musekern.qkv_front_auto(**p)
        torch.cuda.synchronize()
        same = (torch.equal(got[0], want) and torch.equal(got[1], p["key_cache"])
                and torch.equal(got[2], p["value_cache"]))
        return "ok" if same else "replay differs from eager"
    except Exception as e:  # reported, not fatal
        return f"{type(e).__name__}: {str(e)[:120]}"


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    shards = {s.n: s for s in load_config().shards()}
    rows = []
    for n, m in CASES:
        g = torch.Generator(device="cuda").manual_seed(n + m)
        p = _inputs(n, shards[n].num_kv_heads, m, g)
        musekern.prepare_ops(n, [m], num_kv_heads=p["num_kv_heads"])
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        auto = lambda p=p, y=y: musekern.qkv_front_auto(**p, out=y)  # noqa: E731
        mm = lambda p=p, y=y: torch.mm(p["x"], p["weight"].t(), out=y)  # noqa: E731
        auto()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            auto()
            no_sync = "ok"
        except RuntimeError as e:
            no_sync = f"host sync: {str(e)[:80]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        row = {"N": n, "M": m, "auto_sync_us": _host_us(auto, 20, True), "mm_sync_us": _host_us(mm, 20, True),
               "auto_queued_us": _host_us(auto, 50, False), "mm_queued_us": _host_us(mm, 50, False),
               "no_host_sync": no_sync, "capture": _capture(p, n, m, g)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("issue 13's table, re-measured (us per call, host-timed, eager; sync = synchronized after every call, "
          "queued = 50 calls back to back)")
    print(f"{'N':>6} {'M':>5} {'auto sync':>10} {'mm sync':>9} {'auto queued':>12} {'mm queued':>10}  no sync  capture")
    for r in rows:
        print(f"{r['N']:>6} {r['M']:>5} {r['auto_sync_us']:>10.1f} {r['mm_sync_us']:>9.1f} "
              f"{r['auto_queued_us']:>12.1f} {r['mm_queued_us']:>10.1f}  {r['no_host_sync']:<7}  {r['capture']}")
    write_results(args.out, rows)
    return 0


def write_results(path: str | None, rows: list) -> None:
    """rows as JSON with the commit the cubins were built from, the device and torch's version (nothing if no path)."""
    if path:
        with open(path, "w") as f:
            json.dump({**commit_info(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
