"""Bind a call's launch values to a loaded kernel by the names of its ABI (store/abi.py), in its order.

Each op keeps one table: ABI value name -> a Python expression over the call's arguments. `binder` builds,
once per loaded kernel, a function of those arguments that returns the kernel's `param_names` values in
order, so the hot path is one small function call (no per-call dict, no per-name lookups) and the op never
repeats the kernel's parameter order: the order comes from the manifest the kernel was built with.
"""
from __future__ import annotations


class UnboundParameterError(RuntimeError):
    """The cached kernel's ABI names a value this musekern does not know how to compute."""


def binder(label: str, param_names: tuple, values: dict[str, str], args: str):
    """`lambda <args>: [values[name] for name in param_names]`, compiled once.

    `values` holds trusted source text (the op's own table, never user input); `args` is the comma-separated
    argument list of the returned function."""
    unknown = [n for n in param_names if n not in values]
    if unknown:
        raise UnboundParameterError(
            f"the cached kernel {label} takes {', '.join(unknown)}, which this musekern cannot bind: the cache "
            f"was built by another musekern version; rebuild it with `musekern prepare`")
    return eval(f"lambda {args}: [{', '.join(values[n] for n in param_names)}]", {"float": float, "int": int})
