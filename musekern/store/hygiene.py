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
import stat
import time
from pathlib import Path

from .. import env
from . import locks, owndirs, record_folders
from .cache import CACHE_FORMAT, Cache, CacheError, Entry, manifest_bytes, staging_key
from .fs import ReadProblem, atomic_write, read_regular
from .keys import is_key, sha256_hex
from .manifest import parse_json

POLICY_MAX_BYTES = 1 << 16
COUNTERS = ("hit", "miss", "built", "pulled")


# ---------------------------------------------------------------- the cache's own directories (store/owndirs.py)
def own_dirs(cache: Cache) -> list[Path]:
    """Every directory the store makes below the cache directory: the layout's, the registered record folders'
    (store/record_folders.py: the GEMM tuning records' tuning/) and index/<family>/."""
    dirs = [*cache.own_dirs, *(f.path(cache) for f in record_folders.folders())]
    if owndirs.problem(cache.base) is None and owndirs.problem(cache.index_dir) is None:
        with contextlib.suppress(OSError):
            dirs += [cache.index_dir / n for n in sorted(os.listdir(cache.index_dir))]
    return dirs


def check_own_dirs(cache: Cache, command: str) -> None:
    """Refuse (NotOwnDirError, one line naming each and the fix) a cache where a symbolic link or a file stands
    where one of its own directories should be: maintenance never deletes or writes through one."""
    owndirs.check(own_dirs(cache), command)


def remove_entry(cache: Cache, key: str, keep=None, command: str = "clean", skipped: list | None = None) -> str:
    """`Cache.remove_if`, with a key whose lock file is not a file (a directory, a link) skipped: "skipped", and
    one line naming it in `skipped`, instead of stopping the whole command."""
    try:
        return cache.remove_if(key, keep=keep, command=command)
    except locks.LockFileError as e:
        if skipped is not None:
            skipped.append(f"entry {key[:16]} kept: {e}, then re-run `musekern {command}`")
        return "skipped"


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
        except (OSError, ReadProblem, ValueError, KeyError, TypeError):  # a link, a FIFO, a directory: not ours
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
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        with owndirs.opened(cache.root, cache.stats_dir, create=True) as dir_fd:
            fd = os.open(event, flags, 0o644, dir_fd=dir_fd)
    except (OSError, CacheError):  # a link where stats/ (or the counter) should be: never written through
        return
    with contextlib.suppress(OSError):
        os.write(fd, b"." * n)
    os.close(fd)


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
    check_own_dirs(cache, "stats --zero")
    with owndirs.opened(cache.root, cache.stats_dir, "stats --zero") as fd:
        for event in COUNTERS if fd is not None else ():
            owndirs.remove(fd, event)


# ---------------------------------------------------------------- staging debris
def staging(cache: Cache) -> list[dict]:
    """Every item of tmp/: {"path", "key", "live", "bytes"}. Live: its key's lock is held, so its writer is at
    work; not live: debris of a dead writer (or a stray file). Reads only: works on a read-only cache."""
    try:
        with owndirs.opened(cache.root, cache.tmp_dir) as fd:
            names = owndirs.names(fd) if fd is not None else []
    except (OSError, CacheError):  # a link or a file where tmp/ should be: not listed through (stats warns)
        return []
    out = []
    for name in names:
        path = cache.tmp_dir / name
        key = staging_key(name)
        out.append({"path": str(path), "key": key, "live": key is not None and cache.is_locked(key),
                    "bytes": _tree_bytes(path)})
    return out


def _tree_bytes(path: Path) -> int:
    """Bytes of a file, or of a tree (no symbolic link followed: a link counts as itself)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for dirpath, _dirs, files in os.walk(path):  # os.walk follows no link below `path`, a real directory
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def clean_tmp(cache: Cache, dry_run: bool = False, skipped: list | None = None) -> int:
    """Remove the staging debris of dead writers now (no age rule): an item whose key's lock is free, taken
    while holding that lock. A live writer's staging dir is never touched, nor anything a link in tmp/ points at.
    Returns how many were (or, dry run, would be) removed; what could not be is said in `skipped`."""
    if cache.read_only and not dry_run:
        return 0
    check_own_dirs(cache, "clean")
    n = 0
    for f in record_folders.folders():  # killed record writers' temp files (a live writer's stay: not waited for)
        if not records_busy(cache, f):
            n += f.clean_debris(cache, dry_run)
    items = [i for i in staging(cache) if not i["live"]]
    if dry_run:
        return n + len(items)
    with owndirs.opened(cache.root, cache.tmp_dir, "clean") as fd:
        for item in items if fd is not None else ():
            name = Path(item["path"]).name
            if item["key"] is None:
                n += owndirs.remove(fd, name)
                continue
            try:
                with cache.try_lock(item["key"], "clean") as held:
                    if held:  # its writer is gone (a new writer of this key would use a new name)
                        n += owndirs.remove(fd, name)
            except locks.LockFileError as e:
                if skipped is not None:
                    skipped.append(f"staging dir {item['path']} kept: {e}, then re-run `musekern clean`")
    return n


def records_busy(cache: Cache, folder: record_folders.RecordFolder, skipped: list | None = None) -> bool:
    """Whether a writer of a record folder holds its lock now (then its records and temp files stay: waiting for it
    could stall the command); one line in `skipped` when so."""
    lock = folder.lock(cache)
    if not locks.is_held(lock):
        return False
    line = (f"{folder.what}s kept: another process holds {lock} (a writer of them is at work); run "
            "`musekern clean --all` again when it is done")
    if skipped is not None and line not in skipped:
        skipped.append(line)
    return True


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
    try:
        max_size, source, policy_problem = *policy_max_size(cache), None
    except CacheError as e:  # stats does not need the policy: said, not fatal
        max_size, source, policy_problem = None, None, str(e)
    bad_dirs = [f"{d} is {why}" for d in own_dirs(cache) if (why := owndirs.problem(d)) is not None]
    return {"cache_dir": str(cache.root), "format": CACHE_FORMAT, "read_only": cache.read_only,
            "entries": len(entries), "bytes": total, "by_kernel": by_kernel, "by_arch": by_arch,
            "uncommitted": len(cache.entry_keys()) - len(entries), "plans": sorted(plans(cache)),
            **{f.name: f.summary(cache) for f in record_folders.folders()},
            "counters": counters(cache), "max_size": max_size, "max_size_source": source,
            "policy_problem": policy_problem, "not_own_dirs": bad_dirs,
            "staging": {"live": sum(i["live"] for i in items), "debris": sum(not i["live"] for i in items),
                        "debris_bytes": sum(i["bytes"] for i in items if not i["live"])}}


def gc(cache: Cache, max_size: int | None = None, older_than: float | None = None,
       now: float | None = None, dry_run: bool = False, keep=(), skipped: list | None = None,
       command: str = "gc") -> list[Entry]:
    """Remove entries unused for `older_than` seconds, then least recently used ones until the
    cache holds at most `max_size` bytes; never the keys in `keep`, nor an entry a writer holds, nor one used
    since gc looked at it. Returns the removed (or, dry run, removable) entries; an entry that could not be
    removed for a reason the user must fix (its lock file is a directory) is one line in `skipped`."""
    if max_size is None and older_than is None:
        raise ValueError("gc needs max_size and/or older_than")
    if not dry_run:
        cache.require_writable("collect garbage", command)
    check_own_dirs(cache, command)
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
        if remove_entry(cache, e.key, keep=lambda _insp, k=e.key, u=used: cache.last_used(k) > u, command=command,
                        skipped=skipped) == "removed":
            removed.append(e)
    return removed


def repair(cache: Cache) -> dict:
    """`verify --repair`: remove the entries that are bad, each re-checked under its lock first (one that a
    writer replaced meanwhile is kept). Returns {"bad": {key: problems}, "removed": {key: problems seen under
    the lock}, "kept": [keys sound on the re-check], "busy": [keys a writer held], "gone": [keys]}."""
    cache.require_writable("repair", "verify --repair")
    check_own_dirs(cache, "verify --repair")
    bad = cache.audit()
    out: dict = {"bad": bad, "removed": {}, "kept": [], "busy": [], "gone": [], "skipped": []}
    for key in bad:
        seen = {}

        def keep(insp, seen=seen):
            seen["problems"] = list(insp.problems)
            return insp.status != "bad"

        result = remove_entry(cache, key, keep=keep, command="verify --repair", skipped=out["skipped"])
        if result == "removed":
            out["removed"][key] = seen["problems"]
        elif result != "skipped":
            out[result].append(key)
    return out


def clear(cache: Cache) -> dict:
    """`clean --all`: remove every entry no writer holds, their stamps and index markers, every recorded plan,
    the registered record folders' records (the GEMM tuning records) and dead writers' staging debris. Live writers'
    entries and staging dirs, and the lock files, stay. Returns {"removed": [keys], "busy": [keys a writer held],
    "records": {folder name: [names removed]}, "tmp": staging items removed, "skipped": [one line each: what was kept
    and why (a record folder's lock held, a lock file that is a directory)]}."""
    cache.require_writable("clean", "clean")
    check_own_dirs(cache, "clean")
    out: dict = {"removed": [], "busy": [], "records": {}, "skipped": [], "tmp": 0}
    for f in record_folders.folders():
        out["records"][f.name] = [] if records_busy(cache, f, out["skipped"]) else f.clear(cache)
    for k in cache.entry_keys():
        result = remove_entry(cache, k, command="clean", skipped=out["skipped"])
        if result in ("removed", "busy"):
            out[result].append(k)
    for d, doomed in ((cache.plans_dir, lambda n: True),  # every plan; the stamps of entries that are gone
                      (cache.used_dir, lambda n: not is_key(n) or not cache.exists(n))):
        with owndirs.opened(cache.root, d, "clean") as fd:
            for name in owndirs.names(fd) if fd is not None else ():
                if doomed(name):
                    owndirs.remove(fd, name)
    out["tmp"] = clean_tmp(cache, skipped=out["skipped"])
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
    path = cache.policy_path
    fix = (f"remove it (`rm -r {path}`) and keep a new one with `musekern gc --set-max-size SIZE --cache-dir "
           f"{cache.root}` (or set MUSEKERN_MAX_SIZE)")
    try:
        raw = read_regular(path, POLICY_MAX_BYTES, fix="")  # the bounded reader: regular files only, no link
    except FileNotFoundError:
        return None, None
    except (ReadProblem, OSError, ValueError) as e:
        raise CacheError(f"cannot read the size policy: {_one_line(e)}; {fix}") from None
    try:
        d = parse_json(raw, str(path))
        if not isinstance(d, dict) or "max_size" not in d:
            raise ValueError('not {"max_size": BYTES}')
        size = d["max_size"]
        if type(size) is not int or not 0 <= size <= env.MAX_SIZE_BYTES:
            raise ValueError("max_size is not a size in bytes")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CacheError(f"bad size policy {path} ({_one_line(e)}); {fix}") from None
    return size, "policy.json"


def _one_line(e: Exception, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


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


def apply_policy(cache: Cache, keep=(), notes: list | None = None) -> tuple[int | None, list[Entry]]:
    """After prepare: trim the cache down to its size policy, least recently used first, never removing `keep`
    (what this prepare needed). (max size or None, removed entries); nothing on a read-only cache. With `notes`, one
    line each for what the user should know: what was evicted (and which other recorded plans needed it), a limit
    that cannot be met because `keep` alone is larger, an entry that could not be removed."""
    max_size, source = policy_max_size(cache)
    if max_size is None or cache.read_only:
        return max_size, []
    keep = set(keep)
    removed = gc(cache, max_size=max_size, keep=keep, skipped=notes, command="prepare")
    if notes is None:
        return max_size, removed
    limit = f"at most {env.human_size(max_size)} ({'MUSEKERN_MAX_SIZE' if source == 'env' else cache.policy_path})"
    if removed:
        needed = set().union(*plans(cache).values())
        others = sum(e.key in needed for e in removed)
        notes.append(f"size policy {limit}: evicted {len(removed)} least recently used entr"
                     f"{'y' if len(removed) == 1 else 'ies'} ({env.human_size(sum(e.size_bytes for e in removed))})"
                     + (f", {others} of them needed by another recorded plan (its `musekern prepare` builds them "
                        "again)" if others else ""))
    entries = cache.entries()
    total = sum(e.size_bytes for e in entries)
    if total > max_size:
        mine = sum(e.size_bytes for e in entries if e.key in keep)
        notes.append(f"the cache holds {env.human_size(total)}, over its size policy {limit}: this plan's own "
                     f"entries take {env.human_size(mine)} and are never evicted by its prepare; raise the limit "
                     f"(`musekern gc --set-max-size SIZE` or MUSEKERN_MAX_SIZE)")
    return max_size, removed


