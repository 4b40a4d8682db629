#!/usr/bin/env python3
"""Round 38 probe: x in a ring of its own (`qkv_front[x_stages]`) against the plan's shared ring, above 16 tokens.

Per wgmma build the rules give M = 32 / 48 / 64 (TP8, TP4, TP2): the plan's build and, for an x ring of 2 or 3
stages (with and without the receive buffer in the ring), the deepest W ring that still fits two CTAs per SM, where
that is deeper than the plan's.

Here (CPU):  python3 bench/probes/x_ring_explore.py labels      (build them: musekern prepare --variant ...)
There (GPU): timeout 120 python3 bench/probes/x_ring_explore.py check OUT.json   (every candidate's y and caches
             bit for bit against the plan's build on the same inputs: x_stages never changes a bit)
             python3 bench/probes/x_ring_explore.py time OUT.json [REPEATS]   (bench/sweep_variants.py's timing,
             chain and isolated, the candidates round robin; a table last)
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

SHARDS = ((8, 2176, 1), (4, 4352, 2), (2, 8704, 4))


def candidates() -> list:
    """(name, variant, M): the plan's wgmma builds and their x-ring alternatives."""
    from musekern.targets import SMEM_RESERVED_PER_CTA, get_target
    from musekern.variants import front_serves, variant
    from musekern.variants.qkv_front import ring_smem_bytes

    t = get_target("h200")
    out = []
    for tp, n, nkv in SHARDS:
        for m in (32, 48, 64):
            v = variant(n, m, nkv, t)
            if v.warp_split != "wg" or not front_serves(n, m, t):
                continue
            out.append((f"tp{tp}-m{m}-plan", v, m))
            for xs in (2, 3):
                for rir in (False, True):
                    fits = [st for st in range(xs + 1, 10) if 2 * (ring_smem_bytes(st, v.tiles, v.splits, rir, xs)
                                                                   + SMEM_RESERVED_PER_CTA) <= t.smem_per_sm]
                    if not fits or max(fits) <= v.stages:
                        continue
                    st = max(fits)
                    c = replace(v, stages=st, x_stages=xs, recv_in_ring=rir, trigger_ahead=st if v.trigger_ahead else 0)
                    if all(c != o for _, o, _ in out):
                        out.append((f"tp{tp}-m{m}-w{st}x{xs}{'-rir' if rir else ''}", c, m))
    return out


def check(out_json: str) -> int:
    import torch

    from musekern.ops.qkv_front import launch_args
    from musekern.runtime import get_kernel
    from musekern.variants.qkv_front import HIDDEN, launch_grid

    rows, plan_out, bad = [], {}, 0
    for name, v, m in candidates():
        g = torch.Generator(device="cuda").manual_seed(m)
        w = (torch.randn(v.n, HIDDEN, device="cuda", generator=g) / 90).to(torch.bfloat16)
        x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        pos = torch.randint(0, 4096, (m,), device="cuda", generator=g)
        cs = torch.randn(4096, 64, device="cuda", generator=g)
        slots = torch.randperm(64 * 16, device="cuda", generator=g)[:m]
        slots[::7] = -1
        kv = torch.full((2, 64, 16, v.num_kv_heads, 64), -7.0, dtype=torch.bfloat16, device="cuda")
        y = torch.full((m, v.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        get_kernel(v).launch(launch_grid(v), launch_args(x, w, pos, cs, slots, kv[0], kv[1], 1e-5, y))
        torch.cuda.synchronize()
        key = name.rsplit("-", 1)[0] if not name.endswith("-rir") else name.rsplit("-", 2)[0]
        if name.endswith("-plan"):
            plan_out[key] = (y.clone(), kv.clone())
            ok = bool(torch.isfinite(y.float()).all())
        else:
            py, pkv = plan_out[key]
            ok = torch.equal(py, y) and torch.equal(pkv, kv)
        bad += not ok
        rows.append({"name": name, "label": v.label, "M": m, "same_bits_as_plan": ok})
        print(json.dumps(rows[-1]), file=sys.stderr)
    json.dump({"rows": rows}, open(out_json, "w"), indent=1)
    print(f"check: {len(rows) - bad} of {len(rows)} ok")
    return 1 if bad else 0


def time_all(out_json: str, repeats: int) -> int:
    import torch
    from sweep_variants import build_commit, merge_repeats, run

    from musekern.bench.timing import copy_bandwidth
    from musekern.variants.qkv_front import HIDDEN

    bw = copy_bandwidth()
    cands = candidates()
    samples: dict = {}
    for _tp, n, _ in SHARDS:
        weights = [(torch.randn(n, HIDDEN, device="cuda") / 90).to(torch.bfloat16) for _ in range(8)]
        for _ in range(repeats):  # round robin within a shard: A/B pairs see the same drift
            for j, (name, v, m) in enumerate(cands):
                if v.n == n:
                    samples.setdefault(j, []).append({"name": name, **run(v, m, weights, bw, None)})
        del weights
        torch.cuda.empty_cache()
    rows = [merge_repeats(samples[j]) for j in range(len(cands))]
    json.dump({"commit": build_commit(), "device": torch.cuda.get_device_name(), "copy_TBps": round(bw, 3),
               "command": "python3 bench/probes/x_ring_explore.py time OUT.json " + str(repeats),
               "repeats": repeats, "rows": rows}, open(out_json, "w"), indent=1)
    plan = {}
    print(f"{'name':20} {'S':>2} {'st':>2} {'xs':>2} {'chain':>7} {'isol':>7} {'vs plan':>7}  samples (chain)")
    for (name, v, _m), r in zip(cands, rows, strict=True):
        key = name.split("-w")[0].removesuffix("-plan")
        if name.endswith("-plan"):
            plan[key] = r["chain_us"]
        print(f"{name:20} {v.splits:2} {v.stages:2} {v.x_stages:2} {r['chain_us']:7.2f} {r['isolated_us']:7.2f} "
              f"{r['chain_us'] / plan[key]:7.3f}  {r.get('samples', {}).get('chain_us')}")
    return 0


def main(argv) -> int:
    if argv[:1] == ["labels"]:
        print("\n".join(v.label for _, v, _ in candidates()))
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:
        return check(argv[1])
    if argv[:1] == ["time"] and len(argv) in (2, 3):
        return time_all(argv[1], int(argv[2]) if len(argv) == 3 else 3)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
