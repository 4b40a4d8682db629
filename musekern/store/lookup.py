"""The one answer to "is this variant present?": exact key, or another DSL version's build, by policy.

The loader, prepare, doctor and the cache commands all ask `find` with an explicit `Policy`:

- `Policy.build()`: what prepare, export and explain count as present. The exact key; where no DSL is
  installed (nothing could be rebuilt here), the newest build of the same variant by any DSL version.
- `Policy.runtime()`: what the loader launches and doctor reports. Any DSL version's build serves (a
  serving image has no DSL to ask) unless MUSEKERN_AUTOBUILD would compile the exact key on a miss.

`verify=True` re-hashes the cubin: a corrupt entry counts as missing (prepare rebuilds it, doctor reports
it). The loader looks up without it and lets `Cache.load` verify, so a corrupt entry is named, not skipped.
Reads only: nothing here writes, so a read-only cache answers every question.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .cache import Cache, CacheError, Entry
from .keys import PART_NAMES, KeyParts, dsl_version, is_key, version_sort_key


@dataclass(frozen=True)
class Policy:
    other_dsl: bool  # an entry that differs from the wanted key only in dsl_version serves
    verify: bool  # re-hash the cubin; a corrupt entry is a miss

    @classmethod
    def build(cls, verify: bool = True, dsl: str | None | bool = True) -> "Policy":
        """`dsl`: the DSL version installed here (None: none); True (default) asks the package metadata."""
        return cls(other_dsl=(dsl_version() if dsl is True else dsl) is None, verify=verify)

    @classmethod
    def runtime(cls, verify: bool = False, autobuild: bool = False, dsl: str | None | bool = True) -> "Policy":
        return cls(other_dsl=not (autobuild and (dsl_version() if dsl is True else dsl) is not None), verify=verify)


def find(cache: Cache, parts: KeyParts, policy: Policy) -> Entry | None:
    """The entry `parts` asks for under `policy`, else None.

    Exact key first. With `policy.other_dsl`, an entry whose parts equal `parts` except `dsl_version`
    serves; when several do, the highest DSL version wins (ties: smallest key). The family index answers
    that with one directory listing; caches written before the index existed are scanned.

    Without `policy.verify`, an entry whose manifest does not even parse is still returned when nothing
    better serves (as an Entry with an empty manifest), so that `Cache.load` names it as corrupt with its
    fix instead of the caller reporting a miss."""
    key = parts.key()
    if policy.verify:
        exact = cache.sound(key)
    else:
        exact = cache.get(key) or _damaged(cache, key)
    if exact is not None or not policy.other_dsl:
        return exact
    try:
        indexed = [k for k in os.listdir(cache.index_dir / parts.family()) if is_key(k)]
    except OSError:
        indexed = []
    for candidates in (lambda: (cache.get(k) for k in indexed), cache.entries):  # the full scan only if needed
        for entry in _newest_first(_parsed(candidates()), parts):
            if not policy.verify or not cache.verify_entry(entry):
                return entry
    if not policy.verify:
        return next((d for d in map(lambda k: _damaged(cache, k), sorted(indexed)) if d is not None), None)
    return None


def _damaged(cache: Cache, key: str) -> Entry | None:
    """An entry directory whose manifest does not parse, as an Entry with an empty manifest (else None)."""
    if cache.exists(key) and cache.get(key) is None:
        return Entry(key, cache.entry_path(key), {})
    return None


def _parsed(entries):
    """(entry, its KeyParts) for every entry whose manifest parses (the others are `verify`'s business)."""
    for cand in entries:
        if cand is None:
            continue
        try:
            yield cand, cand.parts
        except CacheError:
            continue


def _newest_first(candidates, parts: KeyParts) -> list[Entry]:
    """Entries of `parts`' family (same parts but dsl_version), highest DSL version first, then smallest key."""
    same = [(version_sort_key(cp.dsl_version), cp.dsl_version, cand.key, cand) for cand, cp in candidates
            if cp.differences(parts) in ([], ["dsl_version"])]
    same.sort(key=lambda t: t[2])  # smallest key first ...
    same.sort(key=lambda t: (t[0], t[1]), reverse=True)  # ... within each DSL version, newest version first
    return [t[3] for t in same]


def nearest(cache: Cache, parts: KeyParts) -> tuple[Entry | None, list[str]]:
    """The present entry closest to `parts` and the names of the parts that differ.

    For a miss message ("... differs in dsl_version"). Closeness: fewest differing parts, then same
    kernel/arch first, then the smallest key (deterministic)."""
    best = None
    for cand, cp in _parsed(cache.entries()):
        diff = cp.differences(parts)
        rank = (len(diff), "kernel" in diff, "arch" in diff, cand.key)
        if best is None or rank < best[0]:
            best = (rank, cand, diff)
    return (best[1], best[2]) if best else (None, list(PART_NAMES))


def explain_miss(cache: Cache, parts: KeyParts) -> str:
    """One paragraph for a missing variant: what was wanted and what differs in the nearest entry."""
    entry, diff = nearest(cache, parts)
    head = f"no cache entry for {parts.label} on {parts.arch} (key {parts.key()[:16]}) in {cache.root}"
    if entry is None:
        return head + "; the cache is empty"
    if not diff:
        return head + f"; an identical entry exists at {entry.path}"
    lines = parts.describe_differences(entry.parts)
    return (head + f"; nearest entry {entry.key[:16]} ({entry.label}) differs in {', '.join(diff)}: "
            + "; ".join(lines))
