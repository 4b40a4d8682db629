"""qkv_front builds beyond the plan that the GPU tests launch (tests/test_gpu_qkv_front.py) and
bench/gpu_cache.sh compiles for them: no product code uses these.

- same_bits_alternatives: per lever that must never change a bit (ring depth, PDL trigger, trigger_ahead),
  a build that differs from the given one in that lever only; the GPU tests compare their outputs bit for bit.
- other_warp_split: the warp split the planner did not pick (a different, fixed summation order), checked
  against fp64 and for determinism.
"""
from __future__ import annotations

from dataclasses import replace

ALT_STAGES = 3
ALT_TRIGGER_AHEAD = 4


def same_bits_alternatives(v) -> dict:
    """Per lever, a build of `v` with that lever moved (trigger_ahead only where the trigger is "late")."""
    alts = {"stages": replace(v, stages=ALT_STAGES if v.stages != ALT_STAGES else ALT_STAGES + 1),
            "trigger": replace(v, trigger="late" if v.trigger == "early" else "early", trigger_ahead=0)}
    if v.trigger == "late":
        alts["trigger_ahead"] = replace(v, trigger_ahead=0 if v.trigger_ahead else ALT_TRIGGER_AHEAD)
    return alts


def other_warp_split(v):
    """`v` with the other warp split."""
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
