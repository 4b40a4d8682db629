"""What a variant implies about its launch, checked against the ABI its manifest records: a hook, because the store
names no kernel.

The package layer registers one provider, `declared_abi(kernel, variant_params) -> KernelAbi`: the ABI the
variant's kernel declares, computed without cutlass (`import musekern` registers kernels.declared_abi).
`manifest.check` then asks `problems(...)` for every manifest it checks (Cache.load and verify, bundle import,
remote pull, Cache.put), so a forger who re-seals a manifest (recomputing its digest) around a sibling
variant's ABI, swapped parameter names, or another cluster, dynamic shared memory or PDL setting is refused on
every machine, signed or not.

Strict: the block, the cluster, the dynamic shared memory, PDL, every parameter's name, kind, size, alignment
and fields (name, type, offset, size), and every tensor map (parameter, tensor, dtype, box, swizzle, L2
promotion, OOB fill, interleave) must be equal. Left out: the human text (`doc`, the grid rule), which no
launch reads. A provider that does not know the variant raises ValueError (a problem); one that returns None
declares nothing to check (a kernel it does not cover).
"""
from __future__ import annotations

import contextlib

TYPE_CHECKING = False  # nothing but contextlib at run time: `import musekern` registers the provider
if TYPE_CHECKING:
    from typing import Callable, Iterator

    from .abi import KernelAbi

    Provider = Callable[[str, dict], KernelAbi | None]
_provider: Provider | None = None
MAX_SHOWN = 4  # differences named in the one-line problem


def set_provider(fn: Provider | None) -> Provider | None:
    """Register the declared-ABI provider (None: no check); returns the one it replaces."""
    global _provider
    old, _provider = _provider, fn
    return old


def get_provider() -> Provider | None:
    return _provider


@contextlib.contextmanager
def provider(fn: Provider | None) -> Iterator[None]:
    """`fn` as the provider for the duration of the block (tests)."""
    old = set_provider(fn)
    try:
        yield
    finally:
        set_provider(old)


def _launch(a: dict) -> dict:
    L = a["launch"]
    return {"block": list(L["block"]), "cluster": list(L["cluster"]), "dynamic_smem_bytes": L["dynamic_smem_bytes"],
            "pdl": L["pdl"]}


def _param(p: dict) -> tuple:
    return (p["name"], p["kind"], p["size"], p["align"],
            tuple((f["name"], f["type"], f["offset"], f["size"]) for f in p["fields"]))


_PARAM_FIELDS = ("name", "kind", "size", "align", "fields")
_TMAP_FIELDS = ("param", "tensor", "dtype", "box", "swizzle", "l2_promotion", "oob_fill", "interleave")


def differences(declared: dict, recorded: dict) -> list[str]:
    """Where the recorded ABI (a manifest's, already validated by manifest.check_abi) differs from the declared
    one (both in KernelAbi.to_json form): `field: recorded X, declared Y` each."""
    out = []
    dl, rl = _launch(declared), _launch(recorded)
    out += [f"launch.{k}: recorded {rl[k]}, declared {dl[k]}" for k in dl if dl[k] != rl[k]]
    dp, rp = declared["params"], recorded["params"]
    if len(dp) != len(rp):
        out.append(f"params: recorded {len(rp)} ({', '.join(p['name'] for p in rp)[:80]}), declared {len(dp)} "
                   f"({', '.join(p['name'] for p in dp)[:80]})")
    for i, (d, r) in enumerate(zip(dp, rp, strict=False)):  # the shorter list: the count differs above
        what = [n for n, a, b in zip(_PARAM_FIELDS, _param(r), _param(d), strict=True) if a != b]
        if what:
            out.append(f"params[{i}] {r['name']!r}: {', '.join(what)} differ from the declared {d['name']!r}")
    dt, rt = declared["tensormaps"], recorded["tensormaps"]
    if len(dt) != len(rt):
        out.append(f"tensormaps: recorded {len(rt)}, declared {len(dt)}")
    for i, (d, r) in enumerate(zip(dt, rt, strict=False)):
        what = [f"{k} {r[k]} (declared {d[k]})" for k in _TMAP_FIELDS if str(r[k]) != str(d[k])]
        if what:
            out.append(f"tensormaps[{i}]: {', '.join(what)}")
    return out


def problems(kernel: str, variant: dict, label: str, recorded: dict, symbol: str | None = None) -> list[str]:
    """[] when no provider is registered, it declares nothing for this kernel, or the recorded ABI is what the
    variant declares and the entry `symbol` (the cubin's, store/elf.py) carries the variant's tag (keys.variant_tag,
    which every kernel compiles into its symbol); else one problem naming the first differences."""
    if _provider is None:
        return []
    try:
        declared = _provider(kernel, dict(variant))
    except (ValueError, TypeError, KeyError) as e:
        return [f"variant {label[:120]} is not one this musekern declares ({str(e)[:120]})"]
    if declared is None:
        return []
    from .keys import variant_tag  # here: `import musekern` imports this module and must stay cheap

    diff = differences(declared.to_json(), recorded)
    tag = variant_tag(kernel, dict(variant))
    if symbol is not None and tag not in symbol:
        diff.insert(0, f"symbol: {symbol[:80]!r} is not this variant's (no {tag})")
    if not diff:
        return []
    more = f"; and {len(diff) - MAX_SHOWN} more" if len(diff) > MAX_SHOWN else ""
    return [f"the manifest's ABI is not the one {label[:120]} declares ({'; '.join(d[:160] for d in diff[:MAX_SHOWN])}"
            f"{more}): another variant's build, or edited"]
