"""The on-disk kernel cache: content-addressed entries of `kernel.cubin` + `manifest.json`.

Pure stdlib + platformdirs: the runtime loader imports this module on machines that have
no cutlass, no compiler and maybe no write access, so nothing here imports cutlass, torch
or cuda.

Layout (everything under `<root>/v<CACHE_FORMAT>/`, so a future format can live beside it)::

    entries/<key>/kernel.cubin     the compiled kernel (bytes, never rewritten)
    entries/<key>/manifest.json    everything the loader needs; written LAST (commit marker)
    tmp/                           writers' staging dirs (same filesystem, so rename is atomic)
    locks/<key>.lock               per-key flock files (outside the entry: removing an entry
                                   never removes a lock someone may hold)
    used/<key>                     last-used stamps for `gc` (mtime only; never in the manifest)
    plans/<name>.json              keys each recorded plan needs (`clean --stale`)
    index/<family>/<key>           empty markers: the keys committed per family (all key parts but
                                   dsl_version), so the runtime, which cannot know the DSL version,
                                   finds its entry without reading every manifest

Why this shape:
- *Immutable entries*: an entry is staged in `tmp/`, each file fsynced, the manifest written
  last, and the whole directory renamed into `entries/` in one atomic step. A reader sees
  either no entry or a complete one; a concurrent writer that loses the rename race throws
  its copy away and uses the winner's.
- *Per-key lock*: `get_or_create` takes `flock` on `locks/<key>.lock` and re-checks before
  building, so N processes (CI ranks, NFS clients: Linux emulates flock over NFS with
  fcntl locks) compile each variant once.
- *Integrity*: `load` re-hashes the cubin against the manifest's sha256 and checks that the
  manifest belongs to this key, so a truncated, corrupted or foreign entry is never launched.
- *Read-only deploys*: reads (`get`, `load`, `find`, `entries`, `nearest`, `verify_entry`)
  never create anything; `touch` is a no-op on a read-only cache; writes raise
  ReadOnlyCacheError with one line that says what to do.
- *No timestamps in manifest.json* (bundles must be byte-reproducible) and only JSON and
  cubin bytes on disk (no pickle).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .keys import PART_NAMES, KeyParts, is_key, sha256_hex, version_sort_key

CACHE_FORMAT = 2  # 2: keys leave variant fields at their default out, source hash covers variants/<kernel>.py
ENV_CACHE_DIR = "MUSEKERN_CACHE_DIR"
CUBIN_NAME = "kernel.cubin"
MANIFEST_NAME = "manifest.json"
TMP_MAX_AGE_S = 3600.0  # staging dirs older than this are crash debris (`clean` removes them)

FIX_HINT = ("run `musekern verify --repair{cd}` to drop it, then `musekern prepare{cd}` "
            "(with your --model/--target) to rebuild it")


def default_cache_dir(cli_value: str | None = None) -> Path:
    """--cache-dir > $MUSEKERN_CACHE_DIR > platformdirs.user_cache_dir("musekern")."""
    if cli_value:
        return Path(cli_value).expanduser()
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    import platformdirs  # imported lazily: only the fallback needs it

    return Path(platformdirs.user_cache_dir("musekern"))


def manifest_bytes(manifest: dict) -> bytes:
    """How manifest.json is written (human-readable but deterministic: bundles compare bytes)."""
    return (json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode()


# ---------------------------------------------------------------- errors
class CacheError(Exception):
    """Base class of cache errors; the message says what is wrong and how to fix it."""


class CorruptEntryError(CacheError):
    """A truncated, corrupted or foreign entry: never loaded, treated as a miss by prepare."""

    def __init__(self, key: str, path: Path, problems: list[str], cache_dir: Path | None = None):
        self.key, self.path, self.problems = key, Path(path), list(problems)
        cd = f" --cache-dir {cache_dir}" if cache_dir is not None else ""
        super().__init__(f"corrupt cache entry {key[:16]} at {path}: {'; '.join(problems)}; "
                         + FIX_HINT.format(cd=cd))


class MissingEntryError(CacheError):
    """No committed entry under this key."""


class ReadOnlyCacheError(CacheError):
    """A write was asked of a cache that cannot be written (image layer, chmod, ro mount)."""


# ---------------------------------------------------------------- entries
@dataclass(frozen=True)
class Entry:
    """A committed entry: its manifest parsed; the cubin is not read (see Cache.load)."""
    key: str
    path: Path
    manifest: dict

    @property
    def cubin_path(self) -> Path:
        return self.path / CUBIN_NAME

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_NAME

    @property
    def parts(self) -> KeyParts:
        try:
            return KeyParts.from_json(self.manifest.get("key_parts"))
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptEntryError(self.key, self.path, [f"bad key_parts: {e}"]) from None

    @property
    def kernel(self) -> str:
        return str(self.manifest.get("kernel") or (self.manifest.get("key_parts") or {}).get("kernel", "?"))

    @property
    def arch(self) -> str:
        return str(self.manifest.get("arch") or (self.manifest.get("key_parts") or {}).get("arch", "?"))

    @property
    def label(self) -> str:
        if self.manifest.get("label"):
            return str(self.manifest["label"])
        try:
            return self.parts.label
        except CacheError:
            return "?"

    @property
    def dsl_version(self) -> str:
        return str((self.manifest.get("key_parts") or {}).get("dsl_version", "?"))

    @property
    def size_bytes(self) -> int:
        """Bytes on disk (cubin + manifest); 0 for files that vanished meanwhile."""
        total = 0
        for p in (self.cubin_path, self.manifest_path):
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def summary(self) -> dict:
        return {"key": self.key, "kernel": self.kernel, "arch": self.arch, "label": self.label,
                "dsl_version": self.dsl_version, "size_bytes": self.size_bytes, "path": str(self.path)}


# ---------------------------------------------------------------- locks
_held_lock = threading.Lock()
_held: dict[tuple[str, int], list] = {}  # (lock path, thread) -> [fd, depth]: flock is not reentrant


def _fsync_dir(path: Path) -> None:
    """Make a rename/create in `path` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes, mode: int = 0o444) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `path` via a temp file in the same dir + fsync + rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _write_file(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- the cache
class Cache:
    """A cache directory. Cheap to construct; nothing is created until the first write."""

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser()
        self.base = self.root / f"v{CACHE_FORMAT}"
        self.entries_dir = self.base / "entries"
        self.tmp_dir = self.base / "tmp"
        self.locks_dir = self.base / "locks"
        self.used_dir = self.base / "used"
        self.plans_dir = self.base / "plans"
        self.index_dir = self.base / "index"

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r})"

    # ------------------------------------------------------------ state
    @property
    def read_only(self) -> bool:
        """True when nothing can be written here: the deepest existing directory of the path
        to `entries/` is not writable (chmod, ro mount, image layer), or the root is missing
        and cannot be created. Decided without writing anything."""
        p = self.entries_dir
        while not p.exists():
            if p.parent == p:
                return True
            p = p.parent
        if not p.is_dir():
            return True
        return not os.access(p, os.W_OK | os.X_OK)

    def check_writable(self, what: str) -> None:
        """Raise ReadOnlyCacheError (one line: what could not be done and how to fix it)."""
        self._require_writable(what)

    def _require_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyCacheError(
                f"cache {self.root} is read-only, cannot {what}: pass a writable --cache-dir "
                f"(or set ${ENV_CACHE_DIR}) to musekern prepare")

    def _mkdirs(self, *dirs: Path) -> None:
        try:
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise ReadOnlyCacheError(f"cache {self.root} is not writable ({e.strerror}): pass a writable "
                                         f"--cache-dir (or set ${ENV_CACHE_DIR})") from None
            raise

    def entry_path(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a cache key (64 hex digits): {key!r}")
        return self.entries_dir / key

    # ------------------------------------------------------------ locking
    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Exclusive per-key lock across processes (flock), reentrant within one thread."""
        self._require_writable("take a lock")
        self._mkdirs(self.locks_dir)
        path = str(self.locks_dir / f"{key}.lock")
        me = (path, threading.get_ident())
        with _held_lock:
            held = _held.get(me)
            if held:
                held[1] += 1
        if held:
            try:
                yield
            finally:
                with _held_lock:
                    held[1] -= 1
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                locked = True
            except OSError as e:
                # NFS mounted with `nolock` (or a filesystem without locks): go on unlocked. Entries
                # stay whole (atomic dir rename, first writer wins); the cost is a possible duplicate build.
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                locked = False
            with _held_lock:
                _held[me] = [fd, 1]
            try:
                yield
            finally:
                with _held_lock:
                    _held.pop(me, None)
                if locked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # ------------------------------------------------------------ reads (never write)
    def _read_manifest(self, path: Path):
        """(manifest dict or None, problem or None) of the entry dir `path`."""
        try:
            raw = (path / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            return None, "manifest.json missing (uncommitted or damaged entry)"
        except OSError as e:
            return None, f"manifest.json unreadable: {e.strerror or e}"
        try:
            m = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return None, f"manifest.json is not valid JSON ({e})"
        if not isinstance(m, dict):
            return None, "manifest.json is not a JSON object"
        return m, None

    def get(self, key: str) -> Entry | None:
        """The committed entry under `key` (manifest present and parseable), no hash check."""
        path = self.entry_path(key)
        if not path.is_dir():
            return None
        m, _ = self._read_manifest(path)
        return Entry(key, path, m) if m is not None else None

    def _problems(self, key: str, path: Path, manifest: dict | None, cubin: bytes | None) -> list[str]:
        """Everything wrong with an entry; `cubin` is its bytes (None: missing)."""
        problems = []
        if manifest.get("format") != CACHE_FORMAT:
            problems.append(f"manifest format {manifest.get('format')!r} != {CACHE_FORMAT}")
        if manifest.get("key") != key:
            problems.append(f"foreign entry: manifest key {str(manifest.get('key'))[:16]} != directory {key[:16]}")
        try:
            parts = KeyParts.from_json(manifest.get("key_parts"))
            if parts.key() != key:
                problems.append("foreign entry: key_parts hash to a different key")
            if manifest.get("kernel", parts.kernel) != parts.kernel or manifest.get("arch", parts.arch) != parts.arch:
                problems.append("manifest kernel/arch disagree with key_parts")
        except (ValueError, TypeError, KeyError) as e:
            problems.append(f"bad key_parts: {e}")
        if cubin is None:
            problems.append("kernel.cubin missing")
        else:
            if len(cubin) != manifest.get("cubin_size"):
                problems.append(f"kernel.cubin is {len(cubin)} bytes, manifest says {manifest.get('cubin_size')}"
                                + (" (truncated)" if isinstance(manifest.get("cubin_size"), int)
                                   and len(cubin) < manifest["cubin_size"] else ""))
            elif sha256_hex(cubin) != manifest.get("cubin_sha256"):
                problems.append("kernel.cubin sha256 does not match the manifest (corrupted)")
        return problems

    def _read_checked(self, key: str) -> tuple[Entry, bytes, list[str]]:
        path = self.entry_path(key)
        if not path.is_dir():
            raise MissingEntryError(f"no cache entry {key} in {self.root}")
        m, problem = self._read_manifest(path)
        if m is None:
            return Entry(key, path, {}), b"", [problem]
        try:
            cubin = (path / CUBIN_NAME).read_bytes()
        except FileNotFoundError:
            cubin = None
        entry = Entry(key, path, m)
        return entry, cubin or b"", self._problems(key, path, m, cubin)

    def load(self, key: str) -> tuple[Entry, bytes]:
        """(entry, cubin bytes), the bytes verified against the manifest's sha256 and size.

        Raises MissingEntryError when there is no entry, CorruptEntryError (naming the entry
        and the fix) when it is truncated, corrupted or foreign: such bytes are never returned.
        """
        entry, cubin, problems = self._read_checked(key)
        if problems:
            raise CorruptEntryError(key, entry.path, problems, self.root)
        return entry, cubin

    def verify_entry(self, entry: Entry | str) -> list[str]:
        """Problems of an entry (or key) after re-hashing it; [] when it is sound."""
        key = entry if isinstance(entry, str) else entry.key
        try:
            return self._read_checked(key)[2]
        except MissingEntryError:
            return ["entry missing"]

    def entry_keys(self) -> list[str]:
        """Keys of every entry directory, committed or not (temp dirs and locks live elsewhere)."""
        try:
            names = os.listdir(self.entries_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if is_key(n) and (self.entries_dir / n).is_dir())

    def entries(self) -> list[Entry]:
        """Committed entries sorted by key (uncommitted or unparseable ones are left out)."""
        out = []
        for k in self.entry_keys():
            e = self.get(k)
            if e is not None:
                out.append(e)
        return out

    def audit(self) -> dict[str, list[str]]:
        """Re-hash every entry dir: key -> problems (only keys with problems)."""
        bad = {}
        for k in self.entry_keys():
            problems = self.verify_entry(k)
            if problems:
                bad[k] = problems
        return bad

    def _parsed_entries(self):
        """(entry, its KeyParts) for every entry whose manifest parses (others are `verify`'s business)."""
        return self._parsed(self.entries())

    @staticmethod
    def _parsed(entries):
        for cand in entries:
            if cand is None:
                continue
            try:
                yield cand, cand.parts
            except CacheError:
                continue

    def find(self, parts: KeyParts, any_dsl_version: bool = False) -> Entry | None:
        """The entry for `parts` (exact key). With `any_dsl_version` (the runtime, which has no
        cutlass to ask its version) an entry whose parts equal `parts` except `dsl_version` is
        accepted; when several are, the highest DSL version wins (ties: smallest key). The family
        index answers that with one directory listing; caches without it (written before the index
        existed) are scanned."""
        e = self.get(parts.key())
        if e is not None or not any_dsl_version:
            return e
        try:
            indexed = [k for k in os.listdir(self.index_dir / parts.family()) if is_key(k)]
        except OSError:
            indexed = []
        best = self._newest_dsl(self._parsed(self.get(k) for k in indexed), parts)
        if best is None:
            best = self._newest_dsl(self._parsed_entries(), parts)
        return best

    @staticmethod
    def _newest_dsl(entries, parts: KeyParts) -> Entry | None:
        best = None
        for cand, cp in entries:
            if cp.differences(parts) in ([], ["dsl_version"]):
                rank = (version_sort_key(cp.dsl_version), cp.dsl_version)
                if best is None or rank > best[0] or (rank == best[0] and cand.key < best[1].key):
                    best = (rank, cand)
        return best[1] if best else None

    def index(self, parts: KeyParts, key: str) -> None:
        """Mark `key` in its family's index (best effort: without the marker, `find` scans). Every commit
        does; `prepare` also does for the entries it finds present, so caches written before the index
        existed get their markers."""
        d = self.index_dir / parts.family()
        try:
            d.mkdir(parents=True, exist_ok=True)
            with open(d / key, "ab"):
                pass
        except OSError:
            pass

    def nearest(self, parts: KeyParts) -> tuple[Entry | None, list[str]]:
        """The present entry closest to `parts` and the names of the parts that differ.

        For the loader's miss message ("... differs in dsl_version"). Closeness: fewest
        differing parts, then same kernel/arch first, then the smallest key (deterministic).
        """
        best = None
        for cand, cp in self._parsed_entries():
            diff = cp.differences(parts)
            rank = (len(diff), "kernel" in diff, "arch" in diff, cand.key)
            if best is None or rank < best[0]:
                best = (rank, cand, diff)
        return (best[1], best[2]) if best else (None, list(PART_NAMES))

    def explain_miss(self, parts: KeyParts) -> str:
        """One paragraph for a missing variant: what was wanted and what differs in the nearest entry."""
        entry, diff = self.nearest(parts)
        head = f"no cache entry for {parts.label} on {parts.arch} (key {parts.key()[:16]}) in {self.root}"
        if entry is None:
            return head + "; the cache is empty"
        if not diff:
            return head + f"; an identical entry exists at {entry.path}"
        lines = parts.describe_differences(entry.parts)
        return (head + f"; nearest entry {entry.key[:16]} ({entry.label}) differs in {', '.join(diff)}: "
                + "; ".join(lines))

    # ------------------------------------------------------------ writes
    def put(self, parts: KeyParts, cubin: bytes, manifest: dict) -> Entry:
        """Commit an entry (immutable: if a sound one exists under the key it is kept and returned).

        Adds format/key/key_parts/cubin_sha256/cubin_size to the builder's manifest; a manifest
        that already carries one of them (e.g. pulled from a remote or a bundle) must agree.
        """
        self._require_writable(f"add {parts.label}")
        with self.lock(parts.key()):
            return self._put_locked(parts, cubin, manifest)

    def _full_manifest(self, parts: KeyParts, cubin: bytes, manifest: dict) -> dict:
        key = parts.key()
        added = {"format": CACHE_FORMAT, "key": key, "key_parts": parts.to_json(),
                 "cubin_sha256": sha256_hex(cubin), "cubin_size": len(cubin)}
        full = dict(manifest)
        for k, v in added.items():
            if k in full and full[k] != v:
                raise ValueError(f"manifest field {k!r} = {str(full[k])[:80]!r} disagrees with the entry "
                                 f"({str(v)[:80]!r})")
            full[k] = v
        for k in ("kernel", "arch"):
            if k in full and full[k] != getattr(parts, k):
                raise ValueError(f"manifest {k} {full[k]!r} != key part {getattr(parts, k)!r}")
        # round-trip: only JSON-serialisable data goes to disk
        return json.loads(manifest_bytes(full))

    def _put_locked(self, parts: KeyParts, cubin: bytes, manifest: dict) -> Entry:
        if not isinstance(cubin, (bytes, bytearray)):
            raise TypeError("cubin must be bytes")
        cubin = bytes(cubin)
        key = parts.key()
        full = self._full_manifest(parts, cubin, manifest)
        final = self.entry_path(key)
        if final.exists():
            if not self.verify_entry(key):
                return self.get(key)  # immutable: first writer wins, later puts are no-ops
            self._discard(final)  # damaged: move aside atomically, then replace
        self._mkdirs(self.entries_dir, self.tmp_dir)
        stage = self.tmp_dir / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.mkdir(stage, 0o755)
            _write_file(stage / CUBIN_NAME, cubin)
            _write_file(stage / MANIFEST_NAME, manifest_bytes(full))  # last: the commit marker
            _fsync_dir(stage)
            try:
                os.rename(stage, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # Lost a race with a writer that did not use our lock (or a stale dir): keep theirs
                # if it is sound, else replace it once.
                if self.verify_entry(key):
                    self._discard(final)
                    os.rename(stage, final)
            _fsync_dir(self.entries_dir)
        finally:
            if stage.exists():
                _rmtree(stage)
        e = self.get(key)
        if e is None:
            raise CacheError(f"entry {key} vanished right after it was committed in {self.root}")
        self.index(parts, key)
        return e

    def _discard(self, path: Path) -> None:
        """Remove an entry dir so readers never see it half deleted: rename away, then delete."""
        self._mkdirs(self.tmp_dir)
        trash = self.tmp_dir / f"trash.{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        _rmtree(trash)

    def obtain(self, parts: KeyParts, build: Callable[[], tuple[bytes, dict]], remote=None) -> tuple[Entry, str]:
        """The sound entry for `parts`, and where it came from: "local", "remote" or "built".

        Fast path without a lock (so a read-only cache that has the entry works). On a miss:
        take the per-key lock, re-check (another process may have just built it), try the
        remote, then build. A corrupt local entry counts as a miss and is replaced. With a
        remote that has `upload` set, a freshly built entry is pushed.
        """
        key = parts.key()
        e = self._sound(key)
        if e is not None:
            self.touch(key)
            return e, "local"
        self._require_writable(f"add {parts.label}")
        with self.lock(key):
            e = self._sound(key)  # re-check: another process may have built it while we waited
            if e is not None:
                self.touch(key)
                return e, "local"
            if remote is not None:
                e = remote.pull(parts, self)
                if e is not None:
                    return e, "remote"
            cubin, manifest = build()
            e = self._put_locked(parts, cubin, manifest)
        if remote is not None and getattr(remote, "upload", False):
            remote.push(e, self)
        return e, "built"

    def verified(self, key: str) -> Entry | None:
        """The entry if it exists and verifies (sha256 re-checked), else None (corrupt = miss)."""
        return self._sound(key)

    def _sound(self, key: str) -> Entry | None:
        try:
            entry, _, problems = self._read_checked(key)
        except MissingEntryError:
            return None
        return None if problems else entry

    def get_or_create(self, parts: KeyParts, build: Callable[[], tuple[bytes, dict]],
                      remote=None) -> tuple[Entry, bool]:
        """(entry, built?): each variant is built once across processes (see `obtain`)."""
        e, source = self.obtain(parts, build, remote)
        return e, source == "built"

    def remove(self, key: str) -> None:
        """Delete an entry (and its last-used stamp); a missing entry is not an error."""
        self._require_writable(f"remove entry {key[:16]}")
        with self.lock(key):
            try:
                family = self.get(key).parts.family()
            except (AttributeError, CacheError):  # missing, or a manifest that does not parse
                family = None
            self._discard(self.entry_path(key))
            if family is not None:
                with contextlib.suppress(OSError):
                    (self.index_dir / family / key).unlink()
            with contextlib.suppress(OSError):
                (self.used_dir / key).unlink()

    def touch(self, key: str) -> None:
        """Record that `key` was used now (for gc). Never writes on a read-only cache, never raises."""
        if not is_key(key) or self.read_only:
            return
        stamp = self.used_dir / key
        try:
            try:
                os.utime(stamp)
            except FileNotFoundError:
                self.used_dir.mkdir(parents=True, exist_ok=True)
                with open(stamp, "ab"):
                    pass
        except OSError:
            pass

    def last_used(self, entry: Entry | str) -> float:
        """When the entry was last used: its stamp, else when it was committed."""
        key = entry if isinstance(entry, str) else entry.key
        for p in (self.used_dir / key, self.entries_dir / key / MANIFEST_NAME):
            try:
                return p.stat().st_mtime
            except OSError:
                continue
        return 0.0

    # ------------------------------------------------------------ plans (clean --stale)
    def record_plan(self, name: str, keys) -> Path:
        """Record the keys plan `name` needs (prepare calls this; the whole plan, not a shard)."""
        if not name:
            raise ValueError("a plan needs a name")
        keys = sorted(set(keys))
        for k in keys:
            if not is_key(k):
                raise ValueError(f"not a cache key: {k!r}")
        self._require_writable(f"record plan {name}")
        self._mkdirs(self.plans_dir)
        path = self._plan_path(name)
        _atomic_write(path, manifest_bytes({"format": CACHE_FORMAT, "name": name, "keys": keys}))
        return path

    def _plan_path(self, name: str) -> Path:
        """Any name is allowed (a config path, `a|b`): the file name is a slug plus a hash of it."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[-48:] or "plan"
        return self.plans_dir / f"{slug}.{sha256_hex(name.encode())[:12]}.json"

    def plans(self) -> dict[str, list[str]]:
        """name -> keys of every recorded plan (unreadable records are skipped)."""
        out = {}
        try:
            files = sorted(self.plans_dir.glob("*.json"))
        except OSError:
            return out
        for f in files:
            try:
                d = json.loads(f.read_bytes())
                out[str(d["name"])] = [k for k in d["keys"] if is_key(k)]
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def forget_plan(self, name: str) -> None:
        self._require_writable(f"forget plan {name}")
        with contextlib.suppress(FileNotFoundError):
            self._plan_path(name).unlink()

    def stale_entries(self) -> list[Entry]:
        """Entries no recorded plan needs. Raises CacheError when no plan was ever recorded
        (then every entry would look stale; refusing is safer than deleting everything)."""
        plans = self.plans()
        if not plans:
            raise CacheError(f"no plan is recorded in {self.root}, so no entry can be called stale: "
                             "run `musekern prepare` (it records its plan) first, or use `musekern clean --all`")
        needed = set().union(*plans.values())
        return [e for e in self.entries() if e.key not in needed]

    # ------------------------------------------------------------ hygiene
    def stats(self) -> dict:
        entries = self.entries()
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
        return {"cache_dir": str(self.root), "format": CACHE_FORMAT, "read_only": self.read_only,
                "entries": len(entries), "bytes": total, "by_kernel": by_kernel, "by_arch": by_arch,
                "uncommitted": len(self.entry_keys()) - len(entries), "plans": sorted(self.plans())}

    def gc(self, max_size: int | None = None, older_than: float | None = None,
           now: float | None = None, dry_run: bool = False) -> list[Entry]:
        """Remove entries unused for `older_than` seconds, then least recently used ones until the
        cache holds at most `max_size` bytes. Returns the removed (or, dry run, removable) entries."""
        if max_size is None and older_than is None:
            raise ValueError("gc needs max_size and/or older_than")
        if not dry_run:
            self._require_writable("collect garbage")
        now = time.time() if now is None else now
        lru = sorted(((self.last_used(e), e.key, e) for e in self.entries()), key=lambda t: (t[0], t[1]))
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
                self.remove(e.key)
        return doomed

    def clean_tmp(self, max_age_s: float = TMP_MAX_AGE_S, now: float | None = None) -> int:
        """Delete staging dirs left by crashed writers (only old ones: live writers use new ones)."""
        if self.read_only:
            return 0
        now = time.time() if now is None else now
        n = 0
        try:
            items = list(self.tmp_dir.iterdir())
        except OSError:
            return 0
        for p in items:
            try:
                if now - p.lstat().st_mtime > max_age_s:
                    _rmtree(p) if p.is_dir() else p.unlink()
                    n += 1
            except OSError:
                continue
        return n

    def clear(self) -> int:
        """Remove every entry, stamp, plan and staging dir (locks stay: someone may hold one)."""
        self._require_writable("clean")
        n = 0
        for k in self.entry_keys():
            self.remove(k)
            n += 1
        for d in (self.plans_dir, self.used_dir, self.tmp_dir, self.index_dir):
            _rmtree(d)
        return n
