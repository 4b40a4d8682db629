"""Bind a call's launch values to a loaded kernel by the names of its ABI (store/abi.py), in its order.

Each op keeps one table: ABI value name -> a Python expression over the call's arguments. `binder` builds,
once per loaded kernel (or once per op, over the whole table), a function of those arguments that returns the
values of the names it is given in order, so the hot path is one small function call (no per-call dict, no
per-name lookups). `take` maps an op's own value order (its table's) to a loaded kernel's `param_names`, for
`LoadedKernel.launcher`. Either way the op never repeats the kernel's parameter order: the order comes from
the manifest the kernel was built with.
"""
from __future__ import annotations


class UnboundParameterError(RuntimeError):
    """The cached kernel's ABI names a value this musekern does not know how to compute."""


def _unbound(label: str, param_names: tuple, known) -> None:
    unknown = [n for n in param_names if n not in known]
    if unknown:
        raise UnboundParameterError(
            f"the cached kernel {label} takes {', '.join(unknown)}, which this musekern cannot bind: the cache "
            f"was built by another musekern version; rebuild it with `musekern prepare`")


def take(label: str, param_names: tuple, names: tuple) -> tuple[int, ...]:
    """For each of a loaded kernel's `param_names`, the index of its value among an op's values in `names` order."""
    _unbound(label, param_names, names)
    return tuple(names.index(n) for n in param_names)


def binder(label: str, param_names: tuple, values: dict[str, str], args: str, env: dict | None = None):
    """`lambda <args>: [values[name] for name in param_names]`, compiled once.

    `values` holds trusted source text (the op's own table, never user input); `args` is the comma-separated
    argument list of the returned function; `env` the functions the text may call besides float and int."""
    _unbound(label, param_names, values)
    return eval(f"lambda {args}: [{', '.join(values[n] for n in param_names)}]",
                {"float": float, "int": int, **(env or {})})


class Plans(dict):
    """Call shape -> its launch plan (a launcher, or a marker of another path), resolved once by `resolve(*key)`:
    the hot path is one dict lookup (`plans[key]`; `plans.get(key)` peeks without resolving). Bounded: past `limit`
    shapes it starts over."""

    def __init__(self, resolve, limit: int = 4096):
        super().__init__()
        self._resolve = resolve
        self._limit = limit

    def __missing__(self, key):
        plan = self._resolve(*key)
        if len(self) >= self._limit:
            self.clear()
        self[key] = plan
        return plan
