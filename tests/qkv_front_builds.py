"""qkv_front builds beyond the default plan that the GPU tests launch (tests/test_gpu_qkv_front.py), that
bench/gpu_cache.sh compiles for them, and that bench/front_large_m.py times: no product code uses these.

- same_bits_alternatives: per lever that must never change a bit (ring depth, PDL trigger, trigger_ahead),
  a build that differs from the given one in that lever only; the GPU tests compare their outputs bit for bit.
- other_warp_split: a warp split the planner did not pick (a different, fixed summation order), checked
  against fp64 and for determinism.
- front_builds / front_candidates: the planned builds for M = 17..64 (the default config plans M <= 16 only),
  and the alternatives the bench times beside them.
"""
from __future__ import annotations

from dataclasses import replace

ALT_STAGES = 3
ALT_TRIGGER_AHEAD = 4
# the M values the bench times (issue 13: each side of every tile boundary the front above 16 adds)
TIMED_MS = (16, 17, 24, 32, 33, 48, 64)


def same_bits_alternatives(v) -> dict:
    """Per lever, a build of `v` with that lever moved (trigger_ahead only where the trigger is "late"). A "k"
    build with 4 tiles sums its partials in the W ring (3 stages at least): its alternative ring is deeper."""
    from musekern.variants.qkv_front import W_STAGE_BYTES, red_bytes

    stages = ALT_STAGES if v.stages != ALT_STAGES else ALT_STAGES + 1
    if v.warp_split == "k" and red_bytes(v.tiles) > stages * W_STAGE_BYTES:
        stages = v.stages + 1
    alts = {"stages": replace(v, stages=stages),
            "trigger": replace(v, trigger="late" if v.trigger == "early" else "early", trigger_ahead=0)}
    if v.trigger == "late":
        alts["trigger_ahead"] = replace(v, trigger_ahead=0 if v.trigger_ahead else ALT_TRIGGER_AHEAD)
    return alts


def other_warp_split(v):
    """`v` with a warp split the plan did not pick: "rows" <-> "k" (up to 4 tiles), "2x2" -> "rows"."""
    from musekern.variants.qkv_front import K_SPLIT_MAX_TILES

    if v.warp_split == "rows":
        return replace(v, warp_split="k" if v.tiles <= K_SPLIT_MAX_TILES else "2x2")
    return replace(v, warp_split="rows")


def gpu_test_builds(planned) -> list:
    """Every build beyond `planned` (qkv_front variants) that the GPU tests launch, in a stable order: the
    same-bits alternatives of each, its other warp split and that build at another ring depth."""
    out = []
    for v in planned:
        other = other_warp_split(v)
        for b in (*same_bits_alternatives(v).values(), other, same_bits_alternatives(other)["stages"]):
            if b not in out and b not in planned:
                out.append(b)
    return out


def shards():
    """(tp, n, num_kv_heads) of the bundled model's TP 8, 4, 2, 1 shards."""
    from musekern.config import load_config

    return [(s.tp, s.n, s.num_kv_heads) for s in sorted(load_config().shards(), key=lambda s: -s.tp)]


def front_builds(target) -> list:
    """The planned builds the front takes for M = 17..FRONT_MAX_TOKENS, every shard, in a stable order."""
    from musekern.variants import qkv_front_variants
    from musekern.variants.qkv_front import FRONT_MAX_TOKENS, MAX_TOKENS

    out = []
    for _, n, nkv in shards():
        small = qkv_front_variants(n, nkv, target, MAX_TOKENS)
        out += [v for v in qkv_front_variants(n, nkv, target, FRONT_MAX_TOKENS) if v not in small]
    return out


def front_candidates(target) -> list:
    """(name, variant, M) the bench times beside the plan: the other warp splits at 4 and 8 tiles, and for 8
    tiles (whose 32 KiB stages leave two CTAs per SM a 2-stage ring) rings of one CTA per SM."""
    from musekern.variants import variant

    out = []
    for tp, n, nkv in shards():
        for m in (32, 64):
            v = variant(n, m, nkv, target)
            for ws in ("rows", "k", "2x2"):
                if ws != v.warp_split and not (ws == "k" and v.tiles > 4):
                    out.append((f"tp{tp}-m{m}-{ws}", replace(v, warp_split=ws), m))
        v = variant(n, 64, nkv, target)
        deep = dict(stages=6, warp_split="2x2")
        if tp == 8:  # 68 CTAs alone on their SMs: the deep ring, the next grid landing on the 64 free SMs
            out.append(("tp8-m64-deep", replace(v, **deep, trigger="late", trigger_ahead=6), 64))
        elif tp == 4:  # TP8's grid shape: one CTA per head streaming all of K
            out.append(("tp4-m64-s1-deep", replace(v, **deep, splits=1, trigger="exit", trigger_ahead=0), 64))
        elif tp == 2:  # one CTA per SM: 136 CTAs, 4 of them in a second wave
            out.append(("tp2-m64-deep", replace(v, **deep, trigger="early", trigger_ahead=0), 64))
    return out
