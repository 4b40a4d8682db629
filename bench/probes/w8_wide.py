"""Probe (issue 30): e4m3-weight front builds above M = 16. Written when the planned e4m3 front stopped at 2 token tiles
(M <= 16); its run made TP8's 4-tile build planned (rules.W8_WIDE_TILES). mma.sync builds take 4 and 8 tiles too
(variant.SYNC_TILE_CHOICES), and the weight's conversion is paid once a CTA whatever M is, so wider builds may beat
the FP8 GEMM path (x_quant + _scaled_mm + the epilogue: TP8 M = 64 26.6 us against the bf16 front's 17.7,
bench/results/h100-w8-bench.json@465683e) at M = 17..64.

The builds: the bf16 plan's tiles and k_split at M = 32 / 64, warp_split "k" where its reduction fits the ring, else
"rows", the e4m3 ring's stages. Checked as bench/w8_bench.py checks the planned ones (M at each build's ends), timed
beside the bf16 op and the op's FP8 GEMM path.

Usage: here `python3 bench/probes/w8_wide.py labels` (the builds, for `musekern prepare --variant`); on the GPU
machine `source bench/device_env.sh && python3 bench/probes/w8_wide.py run` (table last).
"""
from __future__ import annotations

import sys

from musekern.kernels.qkv_front import rules
from musekern.kernels.qkv_front.variant import QkvFrontVariant
from musekern.targets import get_target

SHARDS = ((2176, 1), (4352, 2), (17408, 8))  # TP8, TP4, TP1
MS = (32, 64)
KINDS = ("channel", "block")


def wide(n: int, nkv: int, m: int, kind: str) -> QkvFrontVariant:
    t = get_target("h200")
    base = rules.variant(n, m, nkv, t)
    tiles, s = base.tiles, base.k_split
    st = rules.ring_stages(s, t, tiles, n, weight_dtype="fp8_e4m3", weight_scale=kind)
    err = None
    for ws in ("k", "rows"):
        try:
            return QkvFrontVariant(n, nkv, tiles, st, s, 0, rules.pdl_trigger(n, s, t, tiles), warp_split=ws,
                                   trigger_ahead=rules.trigger_ahead(n, s, t, tiles, st), weight_dtype="fp8_e4m3",
                                   weight_scale=kind)
        except ValueError as e:
            err = e
    raise err


def table() -> dict:
    return {(n, "fp8_e4m3", kind, m): wide(n, nkv, m, kind) for n, nkv in SHARDS for m in MS for kind in KINDS}


def run() -> int:
    import json
    import os

    from bench import w8_bench as wb
    from bench.harness.pred import PredKernel
    from musekern.config import load_config

    cfg = load_config()
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    import torch

    torch.zeros(1, device="cuda")  # torch's context first (the predecessor kernel's module loads into it)
    pred = PredKernel()
    tab = table()
    doc = {"check": [], "timing": [], "gemm": []}
    for (n, _, kind, m), v in tab.items():
        nkv = dict(SHARDS)[n]
        for mm in (m - 15, m):  # the build's two ends (its first M past the narrower build, its last)
            r = wb.check(n, nkv, kind, mm, v, eps, theta)
            doc["check"].append(r)
            print(f"check TP{r['tp']} {kind} M={mm}: y {r['y_err']:.4f} (torch {r['torch_y_err']:.4f}) ok={r['ok']}",
                  file=sys.stderr, flush=True)
    for n, nkv in SHARDS:
        for m in MS:
            r = wb.timing(n, nkv, m, tab, eps, theta, pred, 7)
            g = wb.gemm_timing(n, nkv, m, eps, theta, 7)
            doc["timing"].append(r)
            doc["gemm"].append(g)
            print(f"time TP{r['tp']} M={m}: {r['us']} | gemm {g['us']}", file=sys.stderr, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "w8-wide.json"), "w") as f:  # the device's $OUT
        json.dump(doc, f, indent=1)
    print("TP M | bf16 op | e4m3 front ch / blk (chain) | GEMM path ch / blk | after-norm ratio ch / blk | ok")
    for r, g in zip(doc["timing"], doc["gemm"], strict=True):
        u, q, gu = r["us"], r["ratio"], g["us"]
        ok = all(c["ok"] for c in doc["check"] if c["N"] == r["N"] and r["M"] - 15 <= c["M"] <= r["M"])
        print(f"TP{r['tp']} {r['M']} | {u['chain_bf16']:.2f} | {u['chain_fp8_channel']:.2f} / "
              f"{u['chain_fp8_block']:.2f} | {gu['fp8_channel']:.2f} / {gu['fp8_block']:.2f} | "
              f"{q['after_norm_channel']:.3f} / {q['after_norm_block']:.3f} | {ok}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["labels"]:
        print("\n".join(sorted({v.label for v in table().values()})))
        sys.exit(0)
    sys.exit(run())
