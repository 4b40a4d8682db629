"""qkv_front builds beyond the default plan that the GPU tests launch (tests/test_gpu_qkv_front.py), that
bench/gpu_cache.sh compiles for them, and that bench/front_large_m.py times: no product code uses these.

- same_bits_alternatives: per lever that must never change a bit (ring depth, PDL trigger, trigger_ahead),
  a build that differs from the given one in that lever only; the GPU tests compare their outputs bit for bit.
- other_warp_split: a warp split the planner did not pick (a different, fixed summation order), checked
  against fp64 and for determinism.
- front_builds / front_candidates: the builds the rules give M = 17..32 on every shard (the default config plans
  M <= 16 only; front_serves takes them at TP4 and TP2), and the alternatives the bench times beside them.
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
    """`v` with the warp split the plan did not pick ("rows" <-> "k")."""
    return replace(v, warp_split="k" if v.warp_split == "rows" else "rows")


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
    """The builds the rules give M = 17..FRONT_MAX_TOKENS on every shard, served or not (front_serves: the GPU
    tests keep the unserved ones correct too), in a stable order."""
    from musekern.variants import variant
    from musekern.variants.qkv_front import FRONT_MAX_TOKENS, MAX_TOKENS

    out = []
    for _, n, nkv in shards():
        for m in range(MAX_TOKENS + 1, FRONT_MAX_TOKENS + 1):
            v = variant(n, m, nkv, target)
            if v not in out:
                out.append(v)
    return out


def front_candidates(target) -> list:
    """(name, variant, M) the bench times beside the plan: the other warp split at 4 tiles, and TP8's 4-tile
    build with the deep ring (one CTA per SM, 8 stages: is TP8 bound by bytes in flight or by the consumer?)."""
    from musekern.variants import variant

    out = []
    for tp, n, nkv in shards():
        v = variant(n, 32, nkv, target)
        out.append((f"tp{tp}-m32-{other_warp_split(v).warp_split}", other_warp_split(v), 32))
        if tp == 8:
            out.append(("tp8-m32-deep", replace(v, stages=8, trigger_ahead=8), 32))
    return out
