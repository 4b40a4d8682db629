"""Can this cache directory be read, can it be written, and the one-line error when not (path and fix).

Decided without writing anything: from the deepest existing directory of the path to `entries/`.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from . import fs
from .errors import CacheAccessError, CacheError, ReadOnlyCacheError

ENV_CACHE_DIR = "MUSEKERN_CACHE_DIR"
MAINTENANCE = ("gc", "clean", "verify --repair", "stats --zero")  # commands that change a cache in place
_POINT = "point --cache-dir (or MUSEKERN_CACHE_DIR) at a directory"


def write_block(entries_dir: Path) -> tuple[str, str] | None:
    """(kind, why) when nothing can be written under `entries_dir`: kind "notdir" (a file where a directory
    must be) or "readonly" (a read-only mount, no write permission, or no write bit in the directory's mode:
    root is held to mode bits too, so a cache made read-only by chmod is never written); None if writable."""
    p = entries_dir
    while True:
        try:
            st = os.stat(p)
            break
        except FileNotFoundError:
            if p.parent == p:
                return "readonly", "no part of its path exists"
            p = p.parent
        except NotADirectoryError:
            for q in reversed([p, *p.parents]):
                if q.exists() and not q.is_dir():
                    return "notdir", f"{q} is a file"
            return "notdir", f"a part of {p} is a file"
        except OSError as e:
            return "readonly", f"{p}: {fs.reason(e)}"
    if not stat.S_ISDIR(st.st_mode):
        return "notdir", f"{p} is a file"
    with contextlib.suppress(OSError):
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            return "readonly", "read-only file system"
    if not os.access(p, os.W_OK | os.X_OK):
        return "readonly", f"no write permission on {p}"
    if not st.st_mode & 0o222:
        return "readonly", f"{p} has no write permission bit (mode {st.st_mode & 0o777:o})"
    return None


def _fix(command: str) -> str:
    if command in MAINTENANCE:
        return f"make it writable (permissions, a read-write mount), then re-run `musekern {command}`"
    return f"pass a writable --cache-dir (or set ${ENV_CACHE_DIR}) to `musekern {command}`"


def require_writable(root: Path, block: tuple[str, str] | None, what: str, command: str) -> None:
    """Raise for `block` (from write_block): CacheAccessError for a file in the way, else ReadOnlyCacheError."""
    if block is None:
        return
    kind, why = block
    if kind == "notdir":
        raise CacheAccessError(f"cache directory {root} is not a directory ({why}), cannot {what}: {_POINT}")
    raise ReadOnlyCacheError(f"cache {root} is read-only ({why}), cannot {what}: {_fix(command)}")


def write_error(root: Path, e: OSError, path, command: str = "prepare") -> CacheError:
    """The CacheError for an OSError met while writing `path`: read-only, not a directory, cannot be created,
    or (disk full, I/O error, ...) a CacheAccessError naming the path and the fix."""
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ReadOnlyCacheError(f"cache {root} is not writable ({fs.reason(e)}: {path}): {_fix(command)}")
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return CacheAccessError(f"cache directory {root} is not a directory (a file is in the way of {path}): "
                                f"{_POINT}")
    if e.errno == errno.ENOENT:
        return CacheAccessError(f"cannot create cache directory {path}: {fs.reason(e)}; pass a --cache-dir that "
                                "can be created")
    return CacheAccessError(fs.describe(e, path, "cannot write"))


def check_root(root: Path, inner: tuple[Path, ...], must_exist: bool) -> None:
    """Raise CacheAccessError (one line) when the cache directory `root` (and the `inner` directories that
    exist) cannot be read: not a directory, no permission, or (must_exist) missing."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        if must_exist:
            raise CacheAccessError(f"no cache directory at {root}: check --cache-dir / MUSEKERN_CACHE_DIR "
                                   f"(`musekern prepare --cache-dir {root}` creates one)") from None
        return
    except NotADirectoryError:
        raise CacheAccessError(f"cache directory {root} is not a directory (a part of its path is a file): "
                               f"{_POINT}") from None
    except OSError as e:
        raise CacheAccessError(fs.describe(e, root, "cannot reach cache directory")) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheAccessError(f"cache directory {root} is not a directory (it is a file): {_POINT}")
    for d in (root, *inner):
        if d.is_dir() and not os.access(d, os.R_OK | os.X_OK):
            raise CacheAccessError(f"cannot read cache directory {d}: permission denied; fix its permissions "
                                   "(chmod/chown) or pass a readable --cache-dir")
