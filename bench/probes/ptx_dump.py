"""The PTX of every planned h200 build (the bundled config: bf16 and FP8 KV caches, bf16 / e4m3 block / e4m3 channel
weights) and of the builds w8_bench times on every shard (W8A8 ones among them), one file a build, for a PTX-identity
check of a kernel refactor without a GPU: dump before and after, then `diff -r BEFORE AFTER` (no output: every build
compiles to the same PTX, so the GPU evidence of the old sources holds for the new ones). Deterministic (two dumps of
one tree are equal).

Here (build extra; outside the repository, so that PYTHONPATH picks the tree):
  PYTHONPATH=TREE python3 TREE/bench/probes/ptx_dump.py OUT   (~2 min; OUT/<hash>.ptx and .label a build)
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

# (kv cache dtype, weight format) of each plan dumped
PLANS = (("auto", "bf16"), ("fp8", "bf16"), ("auto", "fp8-block"), ("auto", "fp8-channel"), ("fp8", "fp8-block"))


def extra() -> set[str]:
    """The builds beside the plans': every one w8_bench times (bench/w8_labels.py: each shard's bf16 and e4m3 builds),
    and its one-tile W8A8 builds with x quantized in the kernel (x_dtype bf16: kept buildable, as the kernel tests'
    W8A8_IN_KERNEL)."""
    from bench.w8_labels import builds

    w8 = set(builds().values())
    return {v.label for v in w8} | {dataclasses.replace(v, x_dtype="bf16").label for v in w8
                                    if v.warp_split == "wg" and v.tiles == 1}


def labels() -> list[str]:
    """Every label dumped, sorted."""
    from musekern.config import load_config, with_kv_cache_dtype, with_weight_format
    from musekern.plan import plan_model
    from musekern.targets import get_target

    out = extra()
    for kv, wf in PLANS:
        model = with_weight_format(with_kv_cache_dtype(load_config(), kv), wf)
        out |= {e.variant.label for e in plan_model(model, [get_target("h200")])}
    return sorted(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    from musekern.builder.compile import compile_variant
    from musekern.plan import variant_from_label

    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    todo = labels()
    for i, label in enumerate(todo, 1):
        name = hashlib.sha256(label.encode()).hexdigest()[:12]
        (out / f"{name}.ptx").write_text(compile_variant(variant_from_label(label), "sm_90a").ptx)
        (out / f"{name}.label").write_text(label)
        print(f"[{i}/{len(todo)}] {label}", file=sys.stderr, flush=True)
    print(f"{len(todo)} builds -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
