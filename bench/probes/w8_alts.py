"""Probe (issue 30): e4m3 front builds that differ from the plan in one lever, checked and timed beside the planned
ones in one process. Each alternative maps (shard, scale kind, M) to the build that would serve it:

- "split4" (round 47): TP8 (N = 2176) at k_split 4. The planned TP8 e4m3 builds split K in 2: 34 heads x 2 = 68 CTAs,
  so half the SMs convert weights while the other half idle; k_split 4 puts 136 CTAs on (nearly) every SM, each
  converting half the weights (the M = 16 build, 2 token tiles: one tile would give an owner 2 tokens, and the
  epilogue takes 4 a warp; the ring rules' stages, trigger and trigger_ahead for it), serving M = 1-16. Written on
  the hypothesis that the conversion paces the front; its run refuted it (chain equal with channel scales, 8% slower
  with block: bench/results/h100-e4m3-bounds.json, bench/NOTES.md "e4m3 weights").
- "k1" (rounds 48, 52), "k1tp2": TP8's (TP2's) one-tile builds (M = 1-8) with warp_split "k" in place of "rows",
  which the plan then took for them (one token tile under the late trigger). Under "rows" a warp's eight k16 steps of
  a k-tile are one dependent mma chain behind its own loads and conversions (pipelined over two register sets since
  7d19236); "k" gives a warp 4 independent chains of two and loads k-tile i + 1 before the MMAs of k-tile i. Round 52
  (H100, ldmatrix.x4 consumers): TP8 chain e4m3 / bf16 0.769 / 0.763 -> 0.738 / 0.719 (channel / block); the plan
  takes "k" since 1a3b17d.
- "rows1", "rows1tp2" (round 54): the same pairs the other way round, once the plan took "k" for them. Since the plan
  takes W8A8 ("wg", x quantized in the kernel) for TP8's runtime-M one-tile build, "k1" is that build's W8A16 twin.
- "k1tp1" (round 84, H200): TP1's one-tile builds as W8A16 under "k" in place of the planned W8A8 ("wg", x quantized
  ahead by x_quant): TP1 M = 1 streams at 78% of copy on the H200 against 93% on the H100 (h200-w8-bench.json);
  is it the W8A8 build (x_quant's launch ahead) or the stream?
- "deep8" (round 84, H200): TP8's one-tile builds with the deepest ring one CTA an SM holds (the W8A8 build's
  stages come from the W8A16 rule, sized for two CTAs an SM, while its 68 CTAs are alone on their SMs): TP8 M = 1 is
  0.79x bf16 on the H200 against 0.62 on the H100; does it want more bytes in flight for 1.4x the bandwidth?
- "split2tp1" (round 84, H200): TP1's one-tile builds at k_split 2 (544 CTAs of 256 KiB in place of 272 of 512): at
  one CTA an SM the plan's 272 CTAs run in waves of 132, 132 and 8, and the last 8 stream alone; halves that tail.
- "wg4" (round 90, H200): TP8 as W8A8 at k_split 4 with two token tiles (x quantized ahead by x_quant, PDL, as
  TP1's: one tile would give an owner 2 tokens) in place of the plan's W8A8 / W8A16 builds at k_split 2: 136 CTAs
  (nearly every SM) each streaming 16 k-tiles, against 68 of 32; the deepest ring two CTAs an SM hold, the rules'
  trigger. Serves M = 1-16. h200-w8-bench.json's chain times less ~1.7 us (bf16's time over its floor) give each of
  TP8's 68 CTAs ~40 GB/s with e4m3 and ~60 with bf16: if e4m3 is paced per SM, twice the SMs help.
- "plan": the planned builds themselves, M = 1-8, for a run on kernel sources other than the tree's (the loader keys
  a build by its sources, so the same labels launch the other sources' builds): its "planned" and "plan" rows are
  then the same builds, and the comparison is with another run's ratios.

Usage: here `python3 bench/probes/w8_alts.py labels ALT` (for `musekern prepare --variant`); on the GPU machine
`source bench/device_env.sh && python3 bench/probes/w8_alts.py run ALT` (table last; JSON to $OUT/w8-ALT.json).
"""
from __future__ import annotations

import dataclasses
import sys

from musekern.kernels.qkv_front import rules
from musekern.kernels.qkv_front.variant import K_TILES, QkvFrontVariant
from musekern.targets import get_target

N, NKV = 2176, 1  # TP8
KINDS = ("channel", "block")


def split4(kind: str) -> QkvFrontVariant:
    t = get_target("h200")
    base = rules.variant(N, 16, NKV, t, weight_dtype="fp8_e4m3", weight_scale=kind)
    st = rules.ring_stages(4, t, base.tiles, N, weight_dtype="fp8_e4m3", weight_scale=kind)
    return dataclasses.replace(base, k_split=4, stages=st, trigger=rules.pdl_trigger(N, 4, t, base.tiles),
                               trigger_ahead=rules.trigger_ahead(N, 4, t, base.tiles, st))


def wg4(kind: str) -> QkvFrontVariant:
    t, tiles = get_target("h200"), 2
    base = rules.variant(17408, 1, 8, t, weight_dtype="fp8_e4m3", weight_scale=kind)  # TP1's W8A8 build, x ahead
    # the deepest ring two CTAs an SM hold (136 CTAs, clusters of 4, on 132 SMs: one an SM would leave a second wave)
    st = max(s for s in range(rules.MIN_RING_STAGES, K_TILES // 4 + 1)
             if rules.CTAS_PER_SM * (rules.ring_smem_bytes(s, tiles, 4, False, "fp8_e4m3", kind, "wg", base.x_dtype)
                                     + rules.SMEM_RESERVED_PER_CTA) <= t.smem_per_sm)  # (rules.ring_stages' test)
    return dataclasses.replace(base, n=N, num_kv_heads=NKV, k_split=4, tiles=tiles, stages=st, fixed_rows=0,
                               trigger=rules.pdl_trigger(N, 4, t, tiles),
                               trigger_ahead=rules.trigger_ahead(N, 4, t, tiles, st))


def split_as(warp: str):
    """The planned e4m3 build of (kind, m, n, nkv) with warp_split `warp` (a W8A16 one in place of a planned W8A8
    build: its x bf16, the M == 8 build fixed)."""
    def make(kind: str, m: int, n: int, nkv: int) -> QkvFrontVariant:
        v = plan(kind, m, n, nkv)
        if v.warp_split == "wg":
            v = dataclasses.replace(v, x_dtype="bf16", fixed_rows=rules.fixed_rows(m))
        return dataclasses.replace(v, warp_split=warp)
    return make


def deep(kind: str, m: int, n: int, nkv: int) -> QkvFrontVariant:
    """The planned e4m3 build of (kind, m, n, nkv) with the deepest ring one CTA an SM holds (trigger_ahead = stages
    where the plan fires ahead)."""
    v = plan(kind, m, n, nkv)
    t, per_cta = get_target("h200"), (K_TILES + v.k_split - 1) // v.k_split
    st = max(s for s in range(v.stages, per_cta + 1)
             if rules.ring_smem_bytes(s, v.tiles, v.k_split, False, v.weight_dtype, v.weight_scale, v.warp_split,
                                      v.x_dtype) + rules.SMEM_RESERVE_BYTES <= t.max_smem_optin)
    return dataclasses.replace(v, stages=st, trigger_ahead=min(st, per_cta - 1 - st) if v.trigger_ahead else 0)


def split2(kind: str, m: int, n: int, nkv: int) -> QkvFrontVariant:
    """The planned e4m3 build of (kind, m, n, nkv) at k_split 2 (the rules' ring and trigger for it)."""
    v, t = plan(kind, m, n, nkv), get_target("h200")
    st = rules.ring_stages(2, t, v.tiles, n, weight_dtype=v.weight_dtype, weight_scale=kind, x_dtype=v.x_dtype)
    return dataclasses.replace(v, k_split=2, stages=st, trigger=rules.pdl_trigger(n, 2, t, v.tiles),
                               trigger_ahead=rules.trigger_ahead(n, 2, t, v.tiles, st))


def plan(kind: str, m: int, n: int, nkv: int) -> QkvFrontVariant:
    """The planned e4m3 build of (kind, m, n, nkv)."""
    return rules.variant(n, m, nkv, get_target("h200"), weight_dtype="fp8_e4m3", weight_scale=kind)


ONE_TILE = (range(1, 9), (1, 5, 8), (1, 4, 8))  # M served, checked (the ends of its token tile), timed
TP2 = (8704, 4)
TP1 = (17408, 8)
# name: (variant of (kind, m, n, nkv), the M it serves, the M it is checked at (the ends of its token tiles), the M
# timed, the shard (N, KV heads))
ALTS = {
    "split4": (lambda kind, m, n, nkv: split4(kind), range(1, 17), (1, 8, 9, 16), (1, 8, 16), (N, NKV)),
    "wg4": (lambda kind, m, n, nkv: wg4(kind), range(1, 17), (1, 8, 9, 16), (1, 8, 16), (N, NKV)),
    "k1": (split_as("k"), *ONE_TILE, (N, NKV)),
    "k1tp2": (split_as("k"), *ONE_TILE, TP2),
    "rows1": (split_as("rows"), *ONE_TILE, (N, NKV)),
    "rows1tp2": (split_as("rows"), *ONE_TILE, TP2),
    "k1tp1": (split_as("k"), *ONE_TILE, TP1),
    "deep8": (deep, *ONE_TILE, (N, NKV)),
    "split2tp1": (split2, *ONE_TILE, TP1),
    "plan": (plan, *ONE_TILE, (N, NKV)),
}


def table(alt: str) -> dict:
    """{(n, weight_dtype, kind, m): variant} (w8_bench's table keys) for every M the alternative serves."""
    make, ms, _, _, (n, nkv) = ALTS[alt]
    return {(n, "fp8_e4m3", kind, m): make(kind, m, n, nkv) for kind in KINDS for m in ms}


def run(alt: str) -> int:
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
    tab, planned = table(alt), builds()
    check_ms, time_ms, (n, nkv) = ALTS[alt][2:]
    doc = {"alt": alt, "builds": sorted({v.label for v in tab.values()}), "check": [], "timing": []}
    path = os.path.join(os.environ.get("OUT", "."), f"w8-{alt}.json")

    def save() -> None:  # after each row: a run cut by its time limit still leaves what it measured
        doc["ok"] = all(c["ok"] for c in doc["check"])
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    for kind in KINDS:
        for m in check_ms:
            r = wb.check(n, nkv, kind, m, tab[(n, "fp8_e4m3", kind, m)], eps, theta)
            doc["check"].append(r)
            save()
            print(f"check {kind} M={m}: y {r['y_err']:.4f} (torch {r['torch_y_err']:.4f}) ok={r['ok']}",
                  file=sys.stderr, flush=True)
    for m in time_ms:
        for name, t in (("planned", planned), (alt, {**planned, **tab})):
            r = wb.timing(n, nkv, m, t, eps, theta, pred, 7)
            r["builds"] = name
            doc["timing"].append(r)
            save()
            print(f"time {name} M={m}: {r['us']}", file=sys.stderr, flush=True)
    print("M builds | bf16 chain | e4m3 ch / blk chain | ratio ch / blk | after-norm ratio ch / blk")
    for r in doc["timing"]:
        u, q = r["us"], r["ratio"]
        print(f"{r['M']:2d} {r['builds']:7s} | {u['chain_bf16']:.2f} | {u['chain_fp8_channel']:.2f} / "
              f"{u['chain_fp8_block']:.2f} | {q['chain_channel']:.3f} / {q['chain_block']:.3f} | "
              f"{q['after_norm_channel']:.3f} / {q['after_norm_block']:.3f}")
    print(f"checks ok: {doc['ok']}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "labels" and sys.argv[2] in ALTS:
        print("\n".join(sorted({v.label for v in table(sys.argv[2]).values()})))
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "run" and sys.argv[2] in ALTS:
        sys.exit(run(sys.argv[2]))
    print(f"usage: w8_alts.py labels|run {'|'.join(ALTS)}", file=sys.stderr)
    sys.exit(2)
