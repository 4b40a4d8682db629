"""MUSEKERN_AUTOBUILD: compile a variant missing at run time, as the loader's on_miss hook.

The runtime never imports the builder: the ops hand the loader this hook (`ops.checks.on_miss`) when the variable
is on, and the loader calls it on an exact miss (store/lookup.py's policy then wants this DSL version's build).
"""
from __future__ import annotations

from ..store.keys import dsl_version
from .compile import build_variant


def on_miss(variant, arch: str, cache, parts):
    """Compile `variant` for `arch` into `cache` under the key `parts` and return its entry; None where the DSL is not
    installed (the loader then raises its MissingKernelError with the `musekern prepare` command)."""
    if dsl_version() is None:
        return None

    def build():
        b = build_variant(variant, arch)
        return b.cubin, b.manifest

    entry, _ = cache.obtain(parts, build)
    return entry
