"""qkv_front builds beyond the default plan that the GPU tests launch (tests/test_gpu_qkv_front.py), that
bench/gpu_cache.sh compiles for them, and that bench/front_large_m.py times: no product code uses these.

- same_bits_alternatives: per lever that must never change a bit (ring depth, PDL trigger, trigger_ahead, the
  receive buffer's place),
  a build that differs from the given one in that lever only; the GPU tests compare their outputs bit for bit.
- other_warp_split: a warp split the planner did not pick (a different, fixed summation order), checked
  against fp64 and for determinism.
- front_builds / front_candidates: the builds the rules give M = 17..64 on every shard (served or not), and the
  alternatives the bench times beside them.
"""
from __future__ import annotations

from dataclasses import replace

ALT_STAGES = 3
ALT_TRIGGER_AHEAD = 4
# the M values the bench times (issue 13: each side of every tile boundary the front above 16 adds)
TIMED_MS = (16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57, 64)


def same_bits_alternatives(v) -> dict:
    """Per lever, a build of `v` with that lever moved (trigger_ahead only where the trigger is "late"). A "k"
    build with 4 tiles sums its partials in the W ring (3 stages at least): its alternative ring is deeper."""
    from musekern.kernels.qkv_front.variant import W_STAGE_BYTES, red_bytes

    stages = ALT_STAGES if v.stages != ALT_STAGES else ALT_STAGES + 1
    if v.warp_split == "k" and red_bytes(v.tiles) > stages * W_STAGE_BYTES:
        stages = v.stages + 1
    alts = {"stages": replace(v, stages=stages),
            "trigger": replace(v, trigger="late" if v.trigger == "early" else "early", trigger_ahead=0)}
    if v.trigger == "late":
        alts["trigger_ahead"] = replace(v, trigger_ahead=0 if v.trigger_ahead else ALT_TRIGGER_AHEAD)
    if v.recv_in_ring:
        alts["recv_in_ring"] = replace(v, recv_in_ring=False)
    return alts


OTHER_SPLIT = {"rows": "k", "k": "rows", "wg": "k"}


def other_warp_split(v):
    """`v` with a warp split the plan did not pick ("rows" <-> "k", "wg" -> "k"), or None where no other split
    builds (3, 5, 6 tiles: wgmma only; 8 tiles under "k" needs a deeper ring than the plan's)."""
    try:
        return replace(v, warp_split=OTHER_SPLIT[v.warp_split])
    except ValueError:
        return None


def gpu_test_builds(planned) -> list:
    """Every build beyond `planned` (qkv_front variants) that the GPU tests launch, in a stable order: the
    same-bits alternatives of each, its other warp split and that build at another ring depth."""
    out = []
    for v in planned:
        other = other_warp_split(v)
        more = (other, same_bits_alternatives(other)["stages"]) if other else ()
        for b in (*same_bits_alternatives(v).values(), *more):
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
    from musekern.kernels.qkv_front.rules import variant
    from musekern.kernels.qkv_front.variant import FRONT_MAX_TOKENS, MAX_TOKENS

    out = []
    for _, n, nkv in shards():
        for m in range(MAX_TOKENS + 1, FRONT_MAX_TOKENS + 1):
            v = variant(n, m, nkv, target)
            if v not in out:
                out.append(v)
    return out


def front_candidates(target) -> list:
    """(name, variant, M) the bench times beside the plan: per shard the mma.sync 4-tile build (the plan before
    wgmma), a 2-tile wgmma build and each wgmma build with its receive buffer in the ring (a deeper ring at two
    CTAs per SM); at TP8 the wgmma builds with S = 4 (136 CTAs: every SM streams, not 68); each wgmma build with the
    other x multicast choice (`x_mcast`); each odd tile count's build beside the even one above it, and the odd builds
    the plan does not take."""
    from musekern.kernels.qkv_front.rules import ring_stages, variant

    out = []
    for tp, n, nkv in shards():
        v32 = variant(n, 32, nkv, target)
        out.append((f"tp{tp}-m32-k", replace(v32, warp_split="k"), 32))
        v16 = variant(n, 16, nkv, target)
        out.append((f"tp{tp}-m16-wg", replace(v16, warp_split="wg"), 16))
        for m in (32, 48, 64) if tp > 1 else ():  # (TP1's deep ring does not size by it)
            v = variant(n, m, nkv, target)
            st = ring_stages(v.k_split, target, v.tiles, n, recv_in_ring=True)
            out.append((f"tp{tp}-m{m}-rir", replace(v, recv_in_ring=True, stages=st,
                                                    trigger_ahead=st if v.trigger_ahead else 0), m))
        if tp == 8:
            for m in (16, 32, 48, 64):
                v = variant(n, m, nkv, target)
                for rir in (False, True):
                    st = ring_stages(4, target, v.tiles, n, recv_in_ring=rir)
                    out.append((f"tp8-m{m}-s4{'-rir' if rir else ''}",
                                replace(v, k_split=4, stages=st, trigger="exit", trigger_ahead=0, warp_split="wg",
                                        recv_in_ring=rir), m))
        # x multicast between the heads of a pair (half the x bytes read from the L2, the same CTAs streaming W):
        # each wgmma build with the other choice
        for m in (32, 48, 64) if tp > 1 else ():
            v = variant(n, m, nkv, target)
            if v.warp_split == "wg":
                out.append((f"tp{tp}-m{m}-{'no' if v.x_mcast else ''}xmc", replace(v, x_mcast=not v.x_mcast), m))
        if tp in (8, 4):  # 136 CTAs double up on only 4 of 132 SMs: does a PDL trigger before exit pay there?
            for m in (48, 64) if tp == 8 else (64,):
                v = variant(n, m, nkv, target)
                for trig, ahead in (("late", 0), ("late", v.stages), ("early", 0)):
                    out.append((f"tp{tp}-m{m}-{trig}{ahead or ''}", replace(v, trigger=trig, trigger_ahead=ahead), m))
        # an odd tile count (3, 5: M padded to the next 8 tokens) against the even one above it (4, 6), and round 45's
        # odd builds the plan does not take: TP8 5 tiles at S = 2 (S = 4, which it takes there, splits only even
        # counts), TP4 5 tiles with the receive buffer in the ring (a fourth stage), TP4 7 tiles
        for m in (24, 40) if tp > 1 else ():
            v, even = variant(n, m, nkv, target), variant(n, m + 8, nkv, target)
            if v.tiles % 2:
                out.append((f"tp{tp}-m{m}-even{even.tiles}", even, m))
        if tp == 8:
            v, st = variant(n, 32, nkv, target), ring_stages(2, target, 5, n)
            out.append(("tp8-m40-t5s2", replace(v, tiles=5, stages=st, trigger_ahead=st), 40))
        if tp == 4:
            v = variant(n, 40, nkv, target)
            out.append(("tp4-m40-t5rir", replace(v, recv_in_ring=True,
                                                 stages=ring_stages(2, target, 5, n, recv_in_ring=True)), 40))
            v = variant(n, 48, nkv, target)
            out.append(("tp4-m56-t7", replace(v, tiles=7, stages=ring_stages(2, target, 7, n)), 56))
    return out
