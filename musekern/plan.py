"""The planner: every kernel variant a model needs, per target and TP rank, over the kernel registry
(musekern/kernels/__init__.py: REGISTRY, kernel_spec, variant_of, declared_abi).

Pure and deterministic: no cutlass, no GPU, no torch. A new kernel is a new folder under musekern/kernels/ (see
kernels/base.py) plus one line in `kernels.REGISTRY`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .config import ModelConfig
from .kernels import REGISTRY, declared_abi, kernel_spec, variant_of  # noqa: F401  (the registry, re-exported)
from .targets import Target, check_supported


@dataclass(frozen=True)
class PlanEntry:
    """One compiled artifact: a variant of a kernel for a target, and which TP ranks use it."""
    target: Target
    variant: object  # a frozen variant dataclass of a registered kernel
    tps: tuple[int, ...]

    @property
    def kernel(self) -> str:
        return self.variant.kernel

    @property
    def arch(self) -> str:
        return self.target.arch

    def sort_key(self):
        # params leave fields at their default out, so two variants' i-th values may be an int and a str:
        # numbers sort before text (the order of every plan whose values were comparable is kept)
        vals = tuple((0, v) if isinstance(v, (int, float)) else (1, str(v)) for v in self.variant.params().values())
        return (self.target.name, self.kernel, vals)

    def to_json(self) -> dict:
        return {"target": self.target.name, "arch": self.arch, "kernel": self.kernel,
                "variant": self.variant.params(), "label": self.variant.label, "tp": list(self.tps)}


def plan_model(model: ModelConfig, targets: list[Target]) -> list[PlanEntry]:
    """Every variant `model` needs on each target; one entry per distinct (target, variant).

    A target whose arch no kernel builds for (an A100) raises UnsupportedTargetError naming the supported ones."""
    for target in targets:
        check_supported(target)
    by_key: dict = {}
    for target in targets:
        for shard in model.shards():
            for v in (v for spec in REGISTRY.values() for v in spec.planned(model, shard, target)):
                key = (target.name, v)
                tps = by_key.get(key, ())
                by_key[key] = tuple(sorted(set(tps) | {shard.tp}))
    named = {t.name: t for t in targets}
    entries = [PlanEntry(named[name], v, tps) for (name, v), tps in by_key.items()]
    return sorted(entries, key=PlanEntry.sort_key)


def shard_plan(entries: list[PlanEntry], index: int, count: int) -> list[PlanEntry]:
    """Deterministic 1/count of a plan: shard `index` of `count` (1-based), a round robin over the plan's
    distinct builds (arch, variant label) in sorted order. Entries that compile to one cubin (h100 and h200
    share every sm_90a build) fall in one shard, so N CI jobs split the compiles, not just the entries.
    `prepare --shard K/N` builds and `export --shard K/N` exports exactly this."""
    if count < 1 or not 1 <= index <= count:
        raise ValueError(f"shard must be K/N with 1 <= K <= N, got {index}/{count}")
    builds = sorted({(e.arch, e.variant.label) for e in entries})
    mine = {b for i, b in enumerate(builds) if i % count == index - 1}
    return [e for e in sorted(entries, key=PlanEntry.sort_key) if (e.arch, e.variant.label) in mine]


def variant_types() -> dict:
    """kernel name -> its variant class."""
    return {name: spec.variant for name, spec in REGISTRY.items()}


def variant_from_label(label: str):
    """Parse a variant label such as 'qk_norm[dtype=bfloat16,has_scale=True,head_dim=64]'."""
    m = re.fullmatch(r"\s*([a-z_]+)\[(.*)\]\s*", label)
    types = variant_types()
    if not m or m.group(1) not in types:
        raise ValueError(f"not a variant label: {label!r} (expected e.g. "
                         f"'qk_norm[dtype=bfloat16,has_scale=True,head_dim=64]'; `musekern plan` lists them)")
    cls = types[m.group(1)]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for item in filter(None, m.group(2).split(",")):
        name, _, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if name not in fields:
            raise ValueError(f"{label!r}: {cls.kernel} has no parameter {name!r}; parameters: {', '.join(fields)}")
        typ = fields[name].type
        if typ in ("bool", bool):
            if raw not in ("True", "False", "true", "false", "1", "0"):
                raise ValueError(f"{label!r}: {name} must be True or False, got {raw!r}")
            values[name] = raw in ("True", "true", "1")
        elif typ in ("int", int):
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"{label!r}: {name} must be an integer, got {raw!r}") from None
        else:
            values[name] = raw
    missing = {n for n, f in fields.items() if f.default is dataclasses.MISSING} - set(values)
    if missing:
        raise ValueError(f"{label!r}: missing parameter(s) {', '.join(sorted(missing))}")
    return cls(**values)
