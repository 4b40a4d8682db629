"""The on-disk kernel cache: content-addressed entries of `kernel.cubin` + `manifest.json`.

Pure stdlib + platformdirs: the runtime loader imports this module on machines that have
no cutlass, no compiler and maybe no write access, so nothing here imports cutlass, torch
or cuda.

Layout (everything under `<root>/v<CACHE_FORMAT>/`, so a future format can live beside it)::

    entries/<key>/kernel.cubin     the compiled kernel (bytes, never rewritten)
    entries/<key>/manifest.json    everything the loader needs, sealed by its digest; written LAST (commit marker)
    tmp/<key>.<pid>.<rand>         a writer's staging dir; tmp/trash.<key>.* an entry being deleted. Both exist
                                   only while their writer holds <key>'s lock: one whose lock is free is debris
    locks/<key>.lock               per-key flock files (outside the entry: removing an entry
                                   never removes a lock someone may hold)
    used/<key>                     last-used stamps for `gc` (mtime only; never in the manifest)
    plans/<name>.json              keys each recorded plan needs (`clean --stale`)
    index/<family>/<key>           empty markers: the keys committed per family (all key parts but
                                   dsl_version), so the runtime, which cannot know the DSL version,
                                   finds its entry without reading every manifest
    stats/{hit,miss,built,pulled}  counters: one byte appended per event (O_APPEND, no lock), the count is the size
<root>/policy.json                 the lasting size policy (`musekern gc --set-max-size`), beside every format

Why this shape:
- *Immutable entries*: an entry is staged in `tmp/`, each file fsynced, the manifest written
  last, and the whole directory renamed into `entries/` in one atomic step. A reader sees
  either no entry or a complete one; a concurrent writer that loses the rename race throws
  its copy away and uses the winner's.
- *Per-key lock*: `obtain` takes `flock` on `locks/<key>.lock` and re-checks before
  building, so N processes (CI ranks, NFS clients: Linux emulates flock over NFS with
  fcntl locks) compile each variant once. Writers hold it from before their staging dir exists until
  after it is renamed or deleted; maintenance (gc, clean, verify --repair: store/hygiene.py) takes it
  without waiting and skips a key someone holds, and re-checks the entry under it before deleting. So
  maintenance never deletes what a live writer is making, and a staging dir whose key lock is free belongs
  to a dead writer: `clean` removes it at once (no age rule), `stats` shows it.
- *Readers take no lock* (a read-only image has no lock files; the loader's lookup stays cheap): `inspect`
  opens the entry directory once and reads both files through that handle, so an entry removed or replaced
  meanwhile is read whole from the directory it opened, or is reported "gone" (a miss), never "bad".
- *Integrity* (store/manifest.py): every field of manifest.json the loader uses is bound to the key and
  to the cubin's sha256 by the manifest's digest and by re-deriving what the key determines; the cubin is
  re-hashed on every load and checked against what its ELF records (symbol, parameter sizes, block). A
  truncated, corrupted, hand-edited or foreign entry is never loaded. Every read is bounded: regular files
  only, size caps from the manifest, JSON depth and number limits.
- *Read-only deploys*: reads (`get`, `load`, `sound`, `inspect`, `entries`, `verify_entry`, store/lookup.py)
  never create anything; `touch` and `count` are no-ops on a read-only cache (a read-only mount, no write
  permission, or a directory whose mode has no write bit, which root is held to as well); writes raise
  ReadOnlyCacheError with one line that says what to do.
- *No timestamps in manifest.json* (bundles must be byte-reproducible) and only JSON and
  cubin bytes on disk (no pickle).

"Its ABI is the one this musekern computes", without the compiler. The launch ABI is declared next to each
kernel (`abi_for(variant)` in musekern/kernels/, which imports cutlass), so the store cannot recompute it.
What stands in for recomputing it:
1. The key determines the ABI. The key's source hash covers the kernel's source, its variant module and
   store/abi.py (where the ABI record is defined), and the key also holds the variant's params, the arch, the
   DSL version and ABI_VERSION; compiles are deterministic. So for one key there is exactly one ABI, the one
   the build checked against the PTX `.entry` before the entry could be committed (builder/compile.py).
2. The digest binds the recorded ABI to that key and to the cubin's sha256: it cannot change without the
   manifest failing its check.
3. A pulled or imported entry must be the variant that was asked for: its key parts re-derive the key, and
   `RemoteCache.pull(parts)` requires them to equal the requested parts (a bundle entry must re-derive the key
   it is filed under). A remote whose ac/<key> names another variant's blob fails the digest or the cubin
   checks (that cubin's ELF has another symbol and parameter list).
4. The cubin vouches for what it records: the entry symbol, each parameter's size, the required block size,
   its arch.
5. Where the package layer declares it (store/variant_abi.py, a hook `import musekern` fills with
   kernels.declared_abi), the ABI must be exactly what the key's variant declares; and with trusted keys, an entry
   from a remote or a bundle must carry a signature by one of them (store/signing.py).
An entry failing any of these is rejected with a warning (pull, import) or is corrupt (load, verify).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from pathlib import Path
from typing import Callable, Iterator

from . import access, fs, locks, owndirs
from .entry import CUBIN_NAME, MANIFEST_NAME, Entry, Inspection
from .errors import CacheAccessError, CacheError, CorruptEntryError, MissingEntryError, ReadOnlyCacheError
from .fs import ReadProblem, fsync_dir, read_regular, rmtree, write_new_file
from .keys import KeyParts, is_key, sha256_hex
from .manifest import (
    CACHE_FORMAT,
    DIGEST,
    MAX_JSON_ITEMS,
    MAX_MANIFEST_BYTES,
    check,
    cubin_problems,
    manifest_bytes,
    parse_json,
    seal,
)
from .signing import sign_manifest

__all__ = ["CACHE_FORMAT", "manifest_bytes", "Cache", "Entry", "Inspection", "CacheError", "CorruptEntryError",
           "MissingEntryError", "CacheAccessError", "ReadOnlyCacheError", "default_cache_dir"]

ENV_CACHE_DIR = access.ENV_CACHE_DIR
_STAGE_RE = re.compile(r"^(?:trash\.)?([0-9a-f]{64})\.")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def default_cache_dir(cli_value: str | None = None) -> Path:
    """--cache-dir > $MUSEKERN_CACHE_DIR > platformdirs.user_cache_dir("musekern")."""
    if cli_value:
        return Path(cli_value).expanduser()
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    import platformdirs  # imported lazily: only the fallback needs it

    return Path(platformdirs.user_cache_dir("musekern"))


def staging_key(name: str) -> str | None:
    """The key a tmp/ item belongs to (its writer holds that key's lock), or None for a stray name."""
    m = _STAGE_RE.match(name)
    return m.group(1) if m else None


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
        self.stats_dir = self.base / "stats"
        self.policy_path = self.root / "policy.json"

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r})"

    # ------------------------------------------------------------ state
    def _write_block(self):
        return access.write_block(self.entries_dir)

    @property
    def read_only(self) -> bool:
        """True when nothing can be written here (store/access.py: a read-only mount, no write permission, a
        directory whose mode has no write bit, which root is held to too, a file in the way, or a root that
        does not exist and cannot be created)."""
        return self._write_block() is not None

    def require_writable(self, what: str, command: str = "prepare") -> None:
        """Raise CacheAccessError (not a directory) or ReadOnlyCacheError: one line saying what could not be
        done and the fix, for `musekern <command>`."""
        block = self._write_block()
        if block is None and self.read_only:  # `read_only` may be overridden (a subclass, a test)
            block = ("readonly", "it says so")
        access.require_writable(self.root, block, what, command)

    def check_root(self, must_exist: bool = False) -> None:
        """Raise CacheAccessError (one line) when the cache directory cannot be read: not a directory, no
        permission, or (must_exist) missing. A missing directory is otherwise an empty cache."""
        access.check_root(self.root, (self.base, self.entries_dir), must_exist)

    def access_error(self, e: OSError, path, command: str = "prepare") -> CacheError:
        """The CacheError for an OSError met while writing `path` (store/access.py)."""
        return access.write_error(self.root, e, path, command)

    @property
    def own_dirs(self) -> tuple[Path, ...]:
        """The directories the store makes below the cache directory (store/owndirs.py: never followed)."""
        return (self.base, self.entries_dir, self.tmp_dir, self.locks_dir, self.used_dir, self.plans_dir,
                self.index_dir, self.stats_dir)

    def _mkdirs(self, *dirs: Path, command: str = "prepare") -> None:
        """Make `dirs`, following no symbolic link below the cache directory (owndirs.NotOwnDirError)."""
        for d in dirs:
            try:
                owndirs.make(self.root, d, command=command)
            except OSError as e:
                raise self.access_error(e, d, command) from None

    def entry_path(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a cache key (64 hex digits): {key!r}")
        return self.entries_dir / key

    # ------------------------------------------------------------ locking (store/locks.py)
    def _lock_path(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a cache key (64 hex digits): {key!r}")
        return self.locks_dir / f"{key}.lock"

    @contextlib.contextmanager
    def lock(self, key: str, command: str = "prepare") -> Iterator[None]:
        """Exclusive per-key lock across processes (flock), reentrant within one thread; waits for it."""
        self.require_writable("take a lock", command)
        self._mkdirs(self.locks_dir, command=command)
        with locks.held(self._lock_path(key), wait=True, on_error=lambda e, p: self.access_error(e, p, command)):
            yield

    @contextlib.contextmanager
    def try_lock(self, key: str, command: str = "clean") -> Iterator[bool]:
        """The per-key lock if nobody holds it (yields True), else yields False at once (maintenance skips)."""
        self.require_writable("take a lock", command)
        self._mkdirs(self.locks_dir, command=command)
        with locks.held(self._lock_path(key), wait=False,
                        on_error=lambda e, p: self.access_error(e, p, command)) as got:
            yield got

    def is_locked(self, key: str) -> bool:
        """Whether some writer holds `key`'s lock now. Creates and writes nothing (works on a read-only cache)."""
        return locks.is_held(self._lock_path(key))

    # ------------------------------------------------------------ reads (never write)
    def _read_manifest(self, dir_fd: int, path: Path) -> tuple[dict | None, bytes | None, str | None]:
        """(parsed manifest, its bytes, problem) of the entry open at `dir_fd`."""
        try:
            raw = read_regular(MANIFEST_NAME, MAX_MANIFEST_BYTES, dir_fd=dir_fd, shown=path / MANIFEST_NAME)
        except FileNotFoundError:
            return None, None, "manifest.json missing (uncommitted or damaged entry)"
        except ReadProblem as e:
            return None, None, str(e)
        try:
            m = parse_json(raw, "manifest.json", max_items=MAX_JSON_ITEMS)
        except ValueError as e:
            return None, raw, str(e)
        if not isinstance(m, dict):
            return None, raw, "manifest.json is not a JSON object"
        return m, raw, None

    def _open_entry(self, key: str) -> tuple[int | None, Inspection | None]:
        path = self.entry_path(key)
        try:
            return os.open(path, _DIR_FLAGS), None
        except FileNotFoundError:
            return None, Inspection(key, path, "missing")
        except OSError as e:
            if e.errno in (errno.ENOTDIR, errno.ELOOP):
                problem = f"{path} is not a directory (a file or a symbolic link where an entry should be)"
            else:
                problem = fs.describe(e, path, "cannot open entry")
            return None, Inspection(key, path, "bad", Entry(key, path, {}), None, (problem,))

    @staticmethod
    def _moved(path: Path, dir_fd: int) -> bool:
        """Whether `path` no longer names the directory open at `dir_fd` (removed or replaced meanwhile)."""
        try:
            a, b = os.stat(path, follow_symlinks=False), os.fstat(dir_fd)
        except OSError:
            return True
        return (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)

    def inspect(self, key: str) -> Inspection:
        """Read and check the entry `key` (manifest, digest, ABI, cubin hash and ELF), through one handle on
        its directory. Never raises for what is on disk: problems are in the result."""
        fd, done = self._open_entry(key)
        if done is not None:
            return done
        path = self.entry_path(key)
        try:
            m, raw, problem = self._read_manifest(fd, path)
            problems = [problem] if problem else check(m, key, raw)
            cubin = None
            if not problems:
                try:
                    cubin = read_regular(CUBIN_NAME, m["cubin_size"], dir_fd=fd, shown=path / CUBIN_NAME)
                    problems = cubin_problems(m, cubin)
                except FileNotFoundError:
                    problems = cubin_problems(m, None)
                except ReadProblem as e:
                    problems = [str(e)]
            elif m is not None and not os.path.lexists(path / CUBIN_NAME):
                problems.append("kernel.cubin missing")
            if problems and self._moved(path, fd):
                return Inspection(key, path, "gone")
            entry = Entry(key, path, m if m is not None else {})
            if problems:
                return Inspection(key, path, "bad", entry, None, tuple(problems))
            return Inspection(key, path, "sound", entry, cubin)
        finally:
            os.close(fd)

    def get(self, key: str) -> Entry | None:
        """The committed entry under `key` (manifest present and a JSON object), not checked, cubin not read."""
        path = self.entry_path(key)
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError:
            return None
        try:
            m, _, _ = self._read_manifest(fd, path)
        finally:
            os.close(fd)
        return Entry(key, path, m) if m is not None else None

    def exists(self, key: str) -> bool:
        """Whether an entry directory (sound or not) is under `key`."""
        return os.path.lexists(self.entry_path(key))

    def load(self, key: str) -> tuple[Entry, bytes]:
        """(entry, cubin bytes), everything checked (store/manifest.py).

        Raises MissingEntryError when there is no entry (or it was removed meanwhile), CorruptEntryError
        (naming the entry and the fix) when it is truncated, corrupted, edited or foreign: such bytes are
        never returned."""
        for _ in range(2):  # an entry replaced meanwhile is read again once
            insp = self.inspect(key)
            if insp.status == "sound":
                return insp.entry, insp.cubin
            if insp.status == "bad":
                raise CorruptEntryError(key, insp.path, list(insp.problems), self.root)
            if insp.status == "missing":
                break
        raise MissingEntryError(f"no cache entry {key} in {self.root}")

    def sound(self, key: str) -> Entry | None:
        """The entry if it exists and verifies, else None (corrupt = miss)."""
        insp = self.inspect(key)
        return insp.entry if insp.status == "sound" else None

    def verify_entry(self, entry: Entry | str) -> list[str]:
        """Problems of an entry (or key) after re-reading and re-hashing it; [] when it is sound."""
        insp = self.inspect(entry if isinstance(entry, str) else entry.key)
        return {"sound": [], "missing": ["entry missing"], "gone": ["entry removed meanwhile"]}.get(
            insp.status, list(insp.problems))

    def entry_keys(self) -> list[str]:
        """Keys of every entry directory, committed or not (temp dirs and locks live elsewhere).
        Raises CacheAccessError when the directory exists but cannot be listed."""
        try:
            names = os.listdir(self.entries_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise CacheAccessError(fs.describe(e, self.entries_dir, "cannot read cache directory")) from None
        return sorted(n for n in names if is_key(n))

    def entries(self) -> list[Entry]:
        """Committed entries sorted by key (uncommitted or unparseable ones are left out)."""
        out = []
        for k in self.entry_keys():
            e = self.get(k)
            if e is not None:
                out.append(e)
        return out

    def audit(self) -> dict[str, list[str]]:
        """Re-check every entry dir: key -> problems, for the bad ones only (an entry removed meanwhile is
        not bad)."""
        bad = {}
        for k in self.entry_keys():
            insp = self.inspect(k)
            if insp.status == "bad":
                bad[k] = list(insp.problems)
        return bad

    def index(self, parts: KeyParts, key: str) -> None:
        """Mark `key` in its family's index (best effort: without the marker, `find` scans). Every commit
        does; `prepare` also does for the entries it finds present, so caches written before the index
        existed get their markers."""
        try:
            with owndirs.opened(self.root, self.index_dir / parts.family(), create=True) as fd:
                owndirs.create_empty(fd, key)
        except (OSError, CacheError):
            pass

    # ------------------------------------------------------------ writes
    def put(self, parts: KeyParts, cubin: bytes, manifest: dict, command: str = "prepare", sign=None) -> Entry:
        """Commit an entry (immutable: if a sound one exists under the key it is kept and returned).

        Adds format/key/key_parts/cubin_sha256/cubin_size and the digest to the builder's manifest; a
        manifest that already carries one of them (e.g. pulled from a remote or a bundle) must agree, and the
        whole must pass every check `load` applies (ValueError otherwise: nothing is committed that `load`
        would refuse). Raises CacheAccessError (one line: the path and the fix) when it cannot be written.
        `sign`: a store.signing.SecretKey whose signature the committed manifest carries (prepare --sign-key).
        """
        self.require_writable(f"add {parts.label}", command)
        with self.lock(parts.key(), command):
            return self._put_locked(parts, cubin, manifest, command, sign)

    def _full_manifest(self, parts: KeyParts, cubin: bytes, manifest: dict, sign=None) -> dict:
        key = parts.key()
        added = {"format": CACHE_FORMAT, "key": key, "key_parts": parts.to_json(),
                 "cubin_sha256": sha256_hex(cubin), "cubin_size": len(cubin)}
        full = {k: v for k, v in manifest.items() if k != DIGEST}
        for k, v in added.items():
            if k in full and full[k] != v:
                raise ValueError(f"manifest field {k!r} = {str(full[k])[:80]!r} disagrees with the entry "
                                 f"({str(v)[:80]!r})")
            full[k] = v
        for k in ("kernel", "arch"):
            if k in full and full[k] != getattr(parts, k):
                raise ValueError(f"manifest {k} {full[k]!r} != key part {getattr(parts, k)!r}")
        full = seal(parse_json(manifest_bytes(full), "manifest"))  # only JSON-serialisable data goes to disk
        if DIGEST in manifest and manifest[DIGEST] != full[DIGEST]:
            raise ValueError("manifest digest does not match its fields (changed after it was sealed)")
        full = sign_manifest(full, sign)
        problems = check(full, key) or cubin_problems(full, cubin)
        if problems:
            raise ValueError(f"not a valid entry for {parts.label}: {'; '.join(problems)}")
        return full

    def _stage_name(self, key: str, trash: bool = False) -> Path:
        return self.tmp_dir / f"{'trash.' if trash else ''}{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"

    def _put_locked(self, parts: KeyParts, cubin: bytes, manifest: dict, command: str = "prepare",
                    sign=None) -> Entry:
        if not isinstance(cubin, (bytes, bytearray)):
            raise TypeError("cubin must be bytes")
        cubin = bytes(cubin)
        key = parts.key()
        full = self._full_manifest(parts, cubin, manifest, sign)
        final = self.entry_path(key)
        if self.exists(key):
            insp = self.inspect(key)
            if insp.status == "sound":
                return insp.entry  # immutable: first writer wins, later puts are no-ops
            self._discard(final, command)  # damaged: move aside atomically, then replace
        self._mkdirs(self.entries_dir, self.tmp_dir, command=command)
        stage = self._stage_name(key)
        where = stage
        entry = Entry(key, final, full)  # what we verified and wrote (re-reading it would only race bit rot)
        try:
            os.mkdir(stage, 0o755)
            where = stage / CUBIN_NAME
            write_new_file(where, cubin)
            where = stage / MANIFEST_NAME
            write_new_file(where, manifest_bytes(full))  # last: the commit marker
            fsync_dir(stage)
            where = final
            try:
                os.rename(stage, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # Lost a race with a writer that did not use our lock (or a stale dir): keep theirs
                # if it is sound, else replace it once.
                theirs = self.inspect(key)
                if theirs.status == "sound":
                    entry = theirs.entry
                else:
                    self._discard(final, command)
                    os.rename(stage, final)
            fsync_dir(self.entries_dir)
        except OSError as e:
            raise self.access_error(e, where, command) from None
        finally:
            rmtree(stage)
        self.index(parts, key)
        return entry

    def _discard(self, path: Path, command: str = "clean") -> None:
        """Remove an entry dir so readers never see it half deleted: rename away, then delete (the caller
        holds the key's lock, so the trash dir is never taken for a dead writer's)."""
        self._mkdirs(self.tmp_dir, command=command)
        trash = self._stage_name(path.name, trash=True)
        with owndirs.opened(self.root, path.parent, command) as src, \
                owndirs.opened(self.root, self.tmp_dir, command) as dst:  # renameat: no link followed
            try:
                if src is None or dst is None:
                    return
                os.rename(path.name, trash.name, src_dir_fd=src, dst_dir_fd=dst)
            except FileNotFoundError:
                return
            except OSError as e:
                raise self.access_error(e, path, command) from None
            owndirs.remove(dst, trash.name)

    def obtain(self, parts: KeyParts, build: Callable[[], tuple[bytes, dict]], remote=None,
               sign=None) -> tuple[Entry, str]:
        """The sound entry for `parts`, and where it came from: "local", "remote" or "built".

        Fast path without a lock (so a read-only cache that has the entry works). On a miss:
        take the per-key lock, re-check (another process may have just built it), try the
        remote, then build. A corrupt local entry counts as a miss and is replaced. With a
        remote that has `upload` set, a freshly built entry is pushed. `sign`: the key a build is signed with.
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
            e = self._put_locked(parts, cubin, manifest, sign=sign)
        if remote is not None and getattr(remote, "upload", False):
            remote.push(e, self)
        return e, "built"

    def _remove_locked(self, key: str, insp: Inspection, command: str) -> None:
        family = None
        if insp.entry is not None:
            with contextlib.suppress(CacheError):
                family = insp.entry.parts.family()
        self._discard(self.entry_path(key), command)
        if family is not None:
            with contextlib.suppress(OSError):
                owndirs.unlink(self.root, self.index_dir / family / key, command)
        with contextlib.suppress(OSError):
            owndirs.unlink(self.root, self.used_dir / key, command)

    def remove(self, key: str, command: str = "clean") -> None:
        """Delete an entry (and its last-used stamp), waiting for its lock; a missing entry is not an error."""
        self.require_writable(f"remove entry {key[:16]}", command)
        with self.lock(key, command):
            self._remove_locked(key, self.inspect(key), command)

    def remove_if(self, key: str, keep: Callable[[Inspection], bool] | None = None, command: str = "clean") -> str:
        """Maintenance's removal: take `key`'s lock without waiting, re-read the entry under it, and remove it
        unless `keep(inspection)` says otherwise. Returns "removed", "kept", "busy" (a writer holds the lock:
        nothing touched) or "gone" (no entry anymore)."""
        self.require_writable(f"remove entry {key[:16]}", command)
        with self.try_lock(key, command) as held:
            if not held:
                return "busy"
            insp = self.inspect(key)
            if insp.status == "missing":
                return "gone"
            if keep is not None and keep(insp):
                return "kept"
            self._remove_locked(key, insp, command)
            return "removed"

    def touch(self, key: str) -> None:
        """Record that `key` was used now (for gc). Never writes on a read-only cache, never raises."""
        if not is_key(key) or self.read_only:
            return
        try:
            with owndirs.opened(self.root, self.used_dir, create=True) as fd:
                try:
                    os.utime(key, dir_fd=fd, follow_symlinks=False)  # a planted link's own time, never its target's
                except FileNotFoundError:
                    owndirs.create_empty(fd, key)
        except (OSError, CacheError):
            pass

    def last_used(self, entry: Entry | str) -> float:
        """When the entry was last used: its stamp, else when it was committed."""
        key = entry if isinstance(entry, str) else entry.key
        for p in (self.used_dir / key, self.entries_dir / key / MANIFEST_NAME):
            try:
                return os.lstat(p).st_mtime
            except OSError:
                continue
        return 0.0
