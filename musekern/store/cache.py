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
- *Per-key lock*: `obtain` takes `flock` on `locks/<key>.lock` and re-checks before
  building, so N processes (CI ranks, NFS clients: Linux emulates flock over NFS with
  fcntl locks) compile each variant once.
- *Integrity*: `load` re-hashes the cubin against the manifest's sha256 and checks that the
  manifest belongs to this key, so a truncated, corrupted or foreign entry is never launched.
- *Read-only deploys*: reads (`get`, `load`, `sound`, `entries`, `verify_entry`, and store/lookup.py)
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
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .fs import fsync_dir, rmtree, write_new_file
from .keys import KeyParts, is_key, sha256_hex

CACHE_FORMAT = 2  # 2: keys leave variant fields at their default out, source hash covers variants/<kernel>.py
ENV_CACHE_DIR = "MUSEKERN_CACHE_DIR"
CUBIN_NAME = "kernel.cubin"
MANIFEST_NAME = "manifest.json"

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

    def require_writable(self, what: str) -> None:
        """Raise ReadOnlyCacheError (one line: what could not be done and how to fix it)."""
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
        self.require_writable("take a lock")
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

    # ------------------------------------------------------------ writes
    def put(self, parts: KeyParts, cubin: bytes, manifest: dict) -> Entry:
        """Commit an entry (immutable: if a sound one exists under the key it is kept and returned).

        Adds format/key/key_parts/cubin_sha256/cubin_size to the builder's manifest; a manifest
        that already carries one of them (e.g. pulled from a remote or a bundle) must agree.
        """
        self.require_writable(f"add {parts.label}")
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
            write_new_file(stage / CUBIN_NAME, cubin)
            write_new_file(stage / MANIFEST_NAME, manifest_bytes(full))  # last: the commit marker
            fsync_dir(stage)
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
            fsync_dir(self.entries_dir)
        finally:
            if stage.exists():
                rmtree(stage)
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
        rmtree(trash)

    def obtain(self, parts: KeyParts, build: Callable[[], tuple[bytes, dict]], remote=None) -> tuple[Entry, str]:
        """The sound entry for `parts`, and where it came from: "local", "remote" or "built".

        Fast path without a lock (so a read-only cache that has the entry works). On a miss:
        take the per-key lock, re-check (another process may have just built it), try the
        remote, then build. A corrupt local entry counts as a miss and is replaced. With a
        remote that has `upload` set, a freshly built entry is pushed.
        """
        key = parts.key()
        e = self.sound(key)
        if e is not None:
            self.touch(key)
            return e, "local"
        self.require_writable(f"add {parts.label}")
        with self.lock(key):
            e = self.sound(key)  # re-check: another process may have built it while we waited
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

    def sound(self, key: str) -> Entry | None:
        """The entry if it exists and verifies (sha256 re-checked), else None (corrupt = miss)."""
        try:
            entry, _, problems = self._read_checked(key)
        except MissingEntryError:
            return None
        return None if problems else entry

    def remove(self, key: str) -> None:
        """Delete an entry (and its last-used stamp); a missing entry is not an error."""
        self.require_writable(f"remove entry {key[:16]}")
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
