"""Cache hygiene: recorded plans (`clean --stale`), stats and hit/miss counters, gc by last use and size, the
lasting size policy, staging debris, clear, repair.

Safe beside live writers and readers (store/cache.py says why): every removal goes through
`Cache.remove_if`, which takes the entry's lock without waiting (a key a writer holds is skipped, "busy"),
re-reads the entry under the lock and only then decides; a staging dir is removed only while its key's lock
is free, which means its writer is dead. Nothing here removes a whole directory that writers create things
in (tmp/, plans/, used/, index/): a writer between its mkdir and its write never loses the directory.

Counters (`count`, `counters`): how many lookups by `prepare` and the runtime loader hit an entry, missed,
and how many entries were built or pulled from a remote. Kept as stats/<name> in the cache, one byte per
event appended in one write (O_APPEND: no lock, no read-modify-write on the hot path; the count is the file's
size; on NFS an append may be lost, never doubled); never written on a read-only cache, never creating a cache
that does not exist, never raising. The loader counts each load (once per process and variant), prepare its
lookups at the end of the run (so a first prepare's misses count too). Doctor, explain and export look
things up without counting.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from .. import env
from . import tuning
from .cache import CACHE_FORMAT, Cache, CacheError, Entry, manifest_bytes, staging_key
from .fs import atomic_write, read_regular, rmtree
from .keys import is_key, sha256_hex
from .manifest import parse_json

POLICY_MAX_BYTES = 1 << 16
COUNTERS = ("hit", "miss", "built", "pulled")


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
    try:
        atomic_write(path, manifest_bytes({"format": CACHE_FORMAT, "name": name, "keys": keys}))
    except OSError as e:
        raise cache.access_error(e, path) from None
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
            d = parse_json(read_regular(f, 64 << 20), str(f))
            out[str(d["name"])] = [k for k in d["keys"] if is_key(k)]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def forget_plan(cache: Cache, name: str) -> None:
    cache.require_writable(f"forget plan {name}", "clean")
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


# ---------------------------------------------------------------- counters
def count(cache: Cache, event: str, n: int = 1) -> None:
    """Add `n` to counter `event` (hit, miss, built, pulled). See the module docstring."""
    if event not in COUNTERS:
        raise ValueError(f"unknown counter {event!r}")
    if n <= 0 or not cache.base.is_dir() or cache.read_only:
        return
    path = cache.stats_dir / event
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                cache.stats_dir.mkdir(exist_ok=True)
            continue
        except OSError:
            return
        with contextlib.suppress(OSError):
            os.write(fd, b"." * n)
        os.close(fd)
        return


def counters(cache: Cache) -> dict[str, int]:
    out = {}
    for event in COUNTERS:
        try:
            out[event] = os.lstat(cache.stats_dir / event).st_size
        except OSError:
            out[event] = 0
    return out


def zero_counters(cache: Cache) -> None:
    cache.require_writable("zero the counters", "stats --zero")
    for event in COUNTERS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(cache.stats_dir / event)


# ---------------------------------------------------------------- staging debris
def staging(cache: Cache) -> list[dict]:
    """Every item of tmp/: {"path", "key", "live", "bytes"}. Live: its key's lock is held, so its writer is at
    work; not live: debris of a dead writer (or a stray file). Reads only: works on a read-only cache."""
    try:
        names = sorted(os.listdir(cache.tmp_dir))
    except OSError:
        return []
    out = []
    for name in names:
        path = cache.tmp_dir / name
        key = staging_key(name)
        out.append({"path": str(path), "key": key, "live": key is not None and cache.is_locked(key),
                    "bytes": _tree_bytes(path)})
    return out


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    with contextlib.suppress(OSError):
        if not os.path.isdir(path):
            total += os.lstat(path).st_size
    return total


def clean_tmp(cache: Cache, dry_run: bool = False) -> int:
    """Remove the staging debris of dead writers now (no age rule): an item whose key's lock is free, taken
    while holding that lock. A live writer's staging dir is never touched. Returns how many were (or, dry
    run, would be) removed."""
    if cache.read_only and not dry_run:
        return 0
    n = tuning.clean_debris(cache, dry_run)  # killed tuning writers' temp files
    for item in staging(cache):
        if item["live"]:
            continue
        if dry_run:
            n += 1
            continue
        if item["key"] is None:
            rmtree(Path(item["path"]))
            n += 1
            continue
        with cache.try_lock(item["key"], "clean") as held:
            if held:  # its writer is gone (a new writer of this key would use a new name)
                rmtree(Path(item["path"]))
                n += 1
    return n


# ---------------------------------------------------------------- stats, gc, repair, clear
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
    items = staging(cache)
    max_size, source = policy_max_size(cache)
    return {"cache_dir": str(cache.root), "format": CACHE_FORMAT, "read_only": cache.read_only,
            "entries": len(entries), "bytes": total, "by_kernel": by_kernel, "by_arch": by_arch,
            "uncommitted": len(cache.entry_keys()) - len(entries), "plans": sorted(plans(cache)),
            "gemm_tuning": tuning.summary(cache),
            "counters": counters(cache), "max_size": max_size, "max_size_source": source,
            "staging": {"live": sum(i["live"] for i in items), "debris": sum(not i["live"] for i in items),
                        "debris_bytes": sum(i["bytes"] for i in items if not i["live"])}}


def gc(cache: Cache, max_size: int | None = None, older_than: float | None = None,
       now: float | None = None, dry_run: bool = False, keep=()) -> list[Entry]:
    """Remove entries unused for `older_than` seconds, then least recently used ones until the
    cache holds at most `max_size` bytes; never the keys in `keep`, nor an entry a writer holds, nor one used
    since gc looked at it. Returns the removed (or, dry run, removable) entries."""
    if max_size is None and older_than is None:
        raise ValueError("gc needs max_size and/or older_than")
    if not dry_run:
        cache.require_writable("collect garbage", "gc")
    now = time.time() if now is None else now
    keep = set(keep)
    lru = sorted(((cache.last_used(e), e.key, e) for e in cache.entries()), key=lambda t: (t[0], t[1]))
    doomed, kept = [], []
    for used, _, e in lru:
        old = older_than is not None and now - used > older_than
        (doomed if old and e.key not in keep else kept).append((used, e))
    if max_size is not None:
        total = sum(e.size_bytes for _, e in kept)
        for used, e in list(kept):
            if total <= max_size:
                break
            if e.key in keep:
                continue
            kept.remove((used, e))
            doomed.append((used, e))
            total -= e.size_bytes
    if dry_run:
        return [e for _, e in doomed]
    removed = []
    for used, e in doomed:
        # re-checked under the entry's lock: skipped if a writer holds it or someone used it since
        if cache.remove_if(e.key, keep=lambda _insp, k=e.key, u=used: cache.last_used(k) > u, command="gc") \
                == "removed":
            removed.append(e)
    return removed


def repair(cache: Cache) -> dict:
    """`verify --repair`: remove the entries that are bad, each re-checked under its lock first (one that a
    writer replaced meanwhile is kept). Returns {"bad": {key: problems}, "removed": {key: problems seen under
    the lock}, "kept": [keys sound on the re-check], "busy": [keys a writer held], "gone": [keys]}."""
    cache.require_writable("repair", "verify --repair")
    bad = cache.audit()
    out: dict = {"bad": bad, "removed": {}, "kept": [], "busy": [], "gone": []}
    for key in bad:
        seen = {}

        def keep(insp, seen=seen):
            seen["problems"] = list(insp.problems)
            return insp.status != "bad"

        result = cache.remove_if(key, keep=keep, command="verify --repair")
        if result == "removed":
            out["removed"][key] = seen["problems"]
        else:
            out[result].append(key)
    return out


def clear(cache: Cache) -> dict:
    """`clean --all`: remove every entry no writer holds, their stamps and index markers, every recorded plan,
    the GEMM tuning records and dead writers' staging debris. Live writers' entries and staging dirs, and the lock
    files, stay. Returns {"removed": [keys], "busy": [keys a writer held], "tuning": [scopes removed]}."""
    cache.require_writable("clean", "clean")
    out: dict = {"removed": [], "busy": [], "tuning": tuning.clear(cache)}
    for k in cache.entry_keys():
        result = cache.remove_if(k, command="clean")
        if result in ("removed", "busy"):
            out[result].append(k)
    for d, doomed in ((cache.plans_dir, lambda n: True),  # every plan; the stamps of entries that are gone
                      (cache.used_dir, lambda n: not is_key(n) or not cache.exists(n))):
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                if doomed(name):
                    with contextlib.suppress(OSError):
                        os.unlink(d / name)
    clean_tmp(cache)
    return out


# ---------------------------------------------------------------- the lasting size policy
def policy_max_size(cache: Cache) -> tuple[int | None, str | None]:
    """(max bytes, source) of the cache's size policy: $MUSEKERN_MAX_SIZE, else <root>/policy.json (written by
    `musekern gc --set-max-size`), else (None, None). Raises CacheError for an unreadable policy."""
    value, source = env.value(env.MAX_SIZE)
    if source == "env" and value.strip():
        try:
            return env.size(env.MAX_SIZE), "env"
        except env.EnvError as e:
            raise CacheError(str(e)) from None
    try:
        raw = read_regular(cache.policy_path, POLICY_MAX_BYTES)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        raise CacheError(f"cannot read the size policy {cache.policy_path}: {e}; rewrite it with "
                         f"`musekern gc --set-max-size SIZE --cache-dir {cache.root}`") from None
    try:
        d = parse_json(raw, str(cache.policy_path))
        size = d["max_size"]
        if type(size) is not int or size < 0:
            raise ValueError("max_size is not a size in bytes")
    except (ValueError, KeyError, TypeError) as e:
        raise CacheError(f"bad size policy {cache.policy_path} ({e}); rewrite it with "
                         f"`musekern gc --set-max-size SIZE --cache-dir {cache.root}`") from None
    return size, "policy.json"


def set_max_size(cache: Cache, size: int | None) -> Path:
    """Write the lasting size policy (None: remove it)."""
    cache.require_writable("set the size policy", "gc")
    path = cache.policy_path
    try:
        if size is None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        else:
            cache.root.mkdir(parents=True, exist_ok=True)
            atomic_write(path, manifest_bytes({"max_size": int(size)}))
    except OSError as e:
        raise cache.access_error(e, path, "gc") from None
    return path


def apply_policy(cache: Cache, keep=()) -> tuple[int | None, list[Entry]]:
    """After prepare: trim the cache down to its size policy, least recently used first, never removing `keep`
    (what this prepare needed). (max size or None, removed entries); nothing on a read-only cache."""
    max_size, _ = policy_max_size(cache)
    if max_size is None or cache.read_only:
        return max_size, []
    return max_size, gc(cache, max_size=max_size, keep=keep)

