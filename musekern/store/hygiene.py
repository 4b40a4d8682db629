"""Cache hygiene: recorded plans (`clean --stale`), stats, gc by last use and size, staging debris, clear.

Module functions over a `Cache` (store/cache.py owns entries, locks and the commit protocol; everything
here removes through `Cache.remove`, which takes the entry's lock).
"""
from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

from .cache import CACHE_FORMAT, Cache, CacheError, Entry, manifest_bytes
from .fs import atomic_write, rmtree
from .keys import is_key, sha256_hex

TMP_MAX_AGE_S = 3600.0  # staging dirs older than this are crash debris (`clean` removes them)


# ---------------------------------------------------------------- plans (clean --stale)
def record_plan(cache: Cache, name: str, keys) -> Path:
    """Record the keys plan `name` needs (prepare calls this; the whole plan, not a shard)."""
    if not name:
        raise ValueError("a plan needs a name")
    keys = sorted(set(keys))
    for k in keys:
        if not is_key(k):
            raise ValueError(f"not a cache key: {k!r}")
    cache.require_writable(f"record plan {name}")
    cache._mkdirs(cache.plans_dir)
    path = _plan_path(cache, name)
    atomic_write(path, manifest_bytes({"format": CACHE_FORMAT, "name": name, "keys": keys}))
    return path


def _plan_path(cache: Cache, name: str) -> Path:
    """Any name is allowed (a config path, `a|b`): the file name is a slug plus a hash of it."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[-48:] or "plan"
    return cache.plans_dir / f"{slug}.{sha256_hex(name.encode())[:12]}.json"


def plans(cache: Cache) -> dict[str, list[str]]:
    """name -> keys of every recorded plan (unreadable records are skipped)."""
    out = {}
    try:
        files = sorted(cache.plans_dir.glob("*.json"))
    except OSError:
        return out
    for f in files:
        try:
            d = json.loads(f.read_bytes())
            out[str(d["name"])] = [k for k in d["keys"] if is_key(k)]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def forget_plan(cache: Cache, name: str) -> None:
    cache.require_writable(f"forget plan {name}")
    with contextlib.suppress(FileNotFoundError):
        _plan_path(cache, name).unlink()


def stale_entries(cache: Cache) -> list[Entry]:
    """Entries no recorded plan needs. Raises CacheError when no plan was ever recorded
    (then every entry would look stale; refusing is safer than deleting everything)."""
    recorded = plans(cache)
    if not recorded:
        raise CacheError(f"no plan is recorded in {cache.root}, so no entry can be called stale: "
                         "run `musekern prepare` (it records its plan) first, or use `musekern clean --all`")
    needed = set().union(*recorded.values())
    return [e for e in cache.entries() if e.key not in needed]


# ---------------------------------------------------------------- stats, gc, clean
def stats(cache: Cache) -> dict:
    entries = cache.entries()
    by_kernel: dict = {}
    by_arch: dict = {}
    total = 0
    for e in entries:
        size = e.size_bytes
        total += size
        for table, name in ((by_kernel, e.kernel), (by_arch, e.arch)):
            t = table.setdefault(name, {"entries": 0, "bytes": 0})
            t["entries"] += 1
            t["bytes"] += size
    return {"cache_dir": str(cache.root), "format": CACHE_FORMAT, "read_only": cache.read_only,
            "entries": len(entries), "bytes": total, "by_kernel": by_kernel, "by_arch": by_arch,
            "uncommitted": len(cache.entry_keys()) - len(entries), "plans": sorted(plans(cache))}


def gc(cache: Cache, max_size: int | None = None, older_than: float | None = None,
       now: float | None = None, dry_run: bool = False) -> list[Entry]:
    """Remove entries unused for `older_than` seconds, then least recently used ones until the
    cache holds at most `max_size` bytes. Returns the removed (or, dry run, removable) entries."""
    if max_size is None and older_than is None:
        raise ValueError("gc needs max_size and/or older_than")
    if not dry_run:
        cache.require_writable("collect garbage")
    now = time.time() if now is None else now
    lru = sorted(((cache.last_used(e), e.key, e) for e in cache.entries()), key=lambda t: (t[0], t[1]))
    doomed, keep = [], []
    for used, _, e in lru:
        (doomed if older_than is not None and now - used > older_than else keep).append(e)
    if max_size is not None:
        sizes = {e.key: e.size_bytes for e in keep}
        total = sum(sizes.values())
        while keep and total > max_size:
            e = keep.pop(0)  # least recently used first
            total -= sizes[e.key]
            doomed.append(e)
    if not dry_run:
        for e in doomed:
            cache.remove(e.key)
    return doomed


def clean_tmp(cache: Cache, max_age_s: float = TMP_MAX_AGE_S, now: float | None = None) -> int:
    """Delete staging dirs left by crashed writers (only old ones: live writers use new ones)."""
    if cache.read_only:
        return 0
    now = time.time() if now is None else now
    n = 0
    try:
        items = list(cache.tmp_dir.iterdir())
    except OSError:
        return 0
    for p in items:
        try:
            if now - p.lstat().st_mtime > max_age_s:
                rmtree(p) if p.is_dir() else p.unlink()
                n += 1
        except OSError:
            continue
    return n


def clear(cache: Cache) -> int:
    """Remove every entry, stamp, plan and staging dir (locks stay: someone may hold one)."""
    cache.require_writable("clean")
    n = 0
    for k in cache.entry_keys():
        cache.remove(k)
        n += 1
    for d in (cache.plans_dir, cache.used_dir, cache.tmp_dir, cache.index_dir):
        rmtree(d)
    return n
