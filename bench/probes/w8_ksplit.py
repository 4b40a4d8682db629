"""Probe (issue 30): TP8's e4m3 front at k_split 4. The planned e4m3 builds at TP8 (N = 2176) split K in 2: 34 heads x
2 = 68 CTAs, so half the H100's / H200's SMs convert weights while the other half idle. k_split 4 puts 136 CTAs on
(nearly) every SM, each converting half the weights. Written on the hypothesis that the conversion paces the front
(predicted: the chain's e4m3 / bf16 ratio at M = 1-16 down by up to a third); its run refuted it (chain equal with
channel scales, 8% slower with block: bench/results/h100-e4m3-bounds.json, bench/NOTES.md "e4m3 weights").

The builds: the planned TP8 e4m3 build of M = 16 (2 token tiles; at k_split 4 one tile would give an owner 2 tokens,
and the epilogue takes 4 a warp) with k_split 4 and the ring rules' stages, trigger and trigger_ahead for it, serving
every M of 1-16. Checked as bench/w8_bench.py checks the planned ones, timed by w8_bench.timing with
the k_split 4 builds in place of the planned ones (the bf16 op and _scaled_mm beside them in the same graphs).

Usage: here `python3 bench/probes/w8_ksplit.py labels` (for `musekern prepare --variant`); on the GPU machine
`source bench/device_env.sh && python3 bench/probes/w8_ksplit.py run` (table last; JSON to $OUT/w8-ksplit.json).
"""
from __future__ import annotations

import dataclasses
import sys

from musekern.kernels.qkv_front import rules
from musekern.kernels.qkv_front.variant import QkvFrontVariant
from musekern.targets import get_target

N, NKV, SPLIT = 2176, 1, 4
KINDS = ("channel", "block")
CHECK_MS = (1, 8, 9, 16)  # the ends of both token tiles


def split4(kind: str) -> QkvFrontVariant:
    t = get_target("h200")
    base = rules.variant(N, 16, NKV, t, weight_dtype="fp8_e4m3", weight_scale=kind)
    st = rules.ring_stages(SPLIT, t, base.tiles, N, weight_dtype="fp8_e4m3", weight_scale=kind)
    return dataclasses.replace(base, k_split=SPLIT, stages=st, trigger=rules.pdl_trigger(N, SPLIT, t, base.tiles),
                               trigger_ahead=rules.trigger_ahead(N, SPLIT, t, base.tiles, st))


def table() -> dict:
    """{(n, weight_dtype, kind, m): variant} for M = 1..16 (w8_bench's table keys)."""
    return {(N, "fp8_e4m3", kind, m): v for kind in KINDS for v in (split4(kind),) for m in range(1, 17)}


def run() -> int:
    import json
    import os

    import torch

    from bench import w8_bench as wb
    from bench.harness.pred import PredKernel
    from bench.w8_labels import builds
    from musekern.config import load_config

    cfg = load_config()
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    torch.zeros(1, device="cuda")
    pred = PredKernel()
    tab, planned = table(), builds()
    doc = {"builds": sorted({v.label for v in tab.values()}), "check": [], "timing": []}
    for kind in KINDS:
        for m in CHECK_MS:
            r = wb.check(N, NKV, kind, m, tab[(N, "fp8_e4m3", kind, m)], eps, theta)
            doc["check"].append(r)
            print(f"check {kind} M={m}: y {r['y_err']:.4f} (torch {r['torch_y_err']:.4f}) ok={r['ok']}",
                  file=sys.stderr, flush=True)
    for m in (1, 8, 16):
        for name, t in (("planned", planned), ("split4", tab)):
            r = wb.timing(N, NKV, m, t, eps, theta, pred, 7)
            r["builds"] = name
            doc["timing"].append(r)
            print(f"time {name} M={m}: {r['us']}", file=sys.stderr, flush=True)
    doc["ok"] = all(c["ok"] for c in doc["check"])
    with open(os.path.join(os.environ.get("OUT", "."), "w8-ksplit.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print("M builds | bf16 chain | e4m3 ch / blk chain | ratio ch / blk | after-norm ratio ch / blk")
    for r in doc["timing"]:
        u, q = r["us"], r["ratio"]
        print(f"{r['M']:2d} {r['builds']:7s} | {u['chain_bf16']:.2f} | {u['chain_fp8_channel']:.2f} / "
              f"{u['chain_fp8_block']:.2f} | {q['chain_channel']:.3f} / {q['chain_block']:.3f} | "
              f"{q['after_norm_channel']:.3f} / {q['after_norm_block']:.3f}")
    print(f"checks ok: {doc['ok']}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["labels"]:
        print("\n".join(sorted({v.label for v in table().values()})))
        sys.exit(0)
    sys.exit(run())
