"""The cache's own directories, never followed out of the cache: every maintenance path goes through here.

The cache directory itself (--cache-dir, MUSEKERN_CACHE_DIR) may be a symbolic link: where it lives is the user's
choice. Everything below it that the store makes (v2/, and entries/, tmp/, locks/, used/, plans/, index/, stats/,
tuning/ and index/<family>/ in it) must be a real directory. A symbolic link there (planted by someone who can
write the cache, or made by hand) or a file is refused with one line naming it and the fix, never deleted or
written through:

- `check` (the up-front check of clean, clean --all, gc, stats --zero, verify --repair and the size policy after
  prepare) refuses before anything is touched and names every such directory;
- `opened`, `make` and `unlink` walk from the cache directory to the target one component at a time with
  O_NOFOLLOW | O_DIRECTORY and act through that last directory's fd (unlinkat, renameat, openat), so a directory
  swapped for a symbolic link after the check is refused too;
- items inside them are never followed: `remove` unlinks a symbolic link itself (never its target) and removes a
  tree with shutil.rmtree(dir_fd=...), which follows no link; `names` lists without following.

Stdlib only (the runtime loader imports the store).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

from .errors import CacheAccessError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotOwnDirError(CacheAccessError):
    """A symbolic link or a non-directory where the cache keeps a directory of its own (one line: path and fix)."""


def problem(path: Path) -> str | None:
    """What `path` is when it is not a real directory ("a symbolic link to /x", "a file"); None for a real directory
    or nothing at all (a missing directory is made when needed)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        return f"not reachable ({e.strerror or e})"
    if stat.S_ISDIR(st.st_mode):
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link to {os.readlink(path)[:200]}"
        except OSError:
            return "a symbolic link"
    return next((name for test, name in _KINDS if test(st.st_mode)), "not a directory")


def message(bad: list[tuple[Path, str]], command: str) -> str:
    """One line for `bad` [(path, what it is)]: what is wrong, that nothing was touched, the fix."""
    what = "; ".join(f"{p} is {kind}" for p, kind in bad)
    rerun = f" and re-run `musekern {command}`" if command else ""
    return (f"{what}, where the cache keeps a directory of its own: musekern never deletes or writes through it; "
            f"remove {'it' if len(bad) == 1 else 'them'} (`rm {' '.join(str(p) for p, _ in bad)}`: a link goes, "
            f"never what it points at; musekern makes the directory again){rerun}")


def check(dirs, command: str = "") -> None:
    """Raise NotOwnDirError (one line naming every one) when one of `dirs` is a symbolic link or not a directory.
    Reads only (lstat)."""
    bad = [(Path(d), why) for d in dirs if (why := problem(Path(d))) is not None]
    if bad:
        raise NotOwnDirError(message(bad, command))


def _parts(top: Path, path: Path) -> tuple[str, ...]:
    rel = Path(path).relative_to(top).parts
    if any(p in ("..", ".") for p in rel):
        raise ValueError(f"{path} is not below {top}")
    return rel


@contextlib.contextmanager
def opened(top: Path, path: Path, command: str = "", create: bool = False) -> Iterator[int | None]:
    """The directory `path` (at or below the cache directory `top`) opened from `top` one component at a time,
    following no symbolic link below `top`: yields its fd (closed afterwards), or None when a part of it does not
    exist (with `create`, missing parts are made, mode 0o755 less the umask). Raises NotOwnDirError for a symbolic
    link or a non-directory on the way, OSError for anything else."""
    fd = _open_chain(Path(top), _parts(Path(top), path), command, create)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _open_chain(top: Path, rel: tuple[str, ...], command: str, create: bool) -> int | None:
    if create:
        top.mkdir(parents=True, exist_ok=True)  # the cache directory: the user's path, links followed
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    for i, part in enumerate(rel):
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            os.close(fd)
            return None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                where = top.joinpath(*rel[:i + 1])
                raise NotOwnDirError(message([(where, problem(where) or "not a directory")], command)) from None
            raise
        os.close(fd)
        fd = nxt
    return fd


def make(top: Path, *dirs: Path, command: str = "") -> None:
    """Make each of `dirs` (below the cache directory `top`) and every missing part of it, following no symbolic
    link below `top`: NotOwnDirError where one is in the way, OSError (e.filename set) for anything else."""
    for d in dirs:
        try:
            with opened(top, d, command, create=True):
                pass
        except NotOwnDirError:
            raise
        except OSError as e:
            e.filename = e.filename or str(d)
            raise


def names(fd: int) -> list[str]:
    """The names in the directory open at `fd` (nothing followed; an unreadable directory lists as empty)."""
    try:
        with os.scandir(fd) as it:
            return sorted(e.name for e in it)
    except OSError:
        return []


def lstat_at(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None


def remove(fd: int, name: str) -> bool:
    """Remove `name` from the directory open at `fd`: a file or a symbolic link (the link, never its target) is
    unlinked, a directory removed as a whole tree without following any link in it. False when it was not there
    (or could not be removed)."""
    st = lstat_at(fd, name)
    if st is None:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, ignore_errors=True, dir_fd=fd)
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=fd)
    return lstat_at(fd, name) is None


def unlink(top: Path, path: Path, command: str = "") -> bool:
    """Unlink the file `path` (below `top`) through its directory's fd, following no symbolic link below `top`;
    False when it (or its directory) is not there. NotOwnDirError for a link or a file on the way."""
    path = Path(path)
    with opened(top, path.parent, command) as fd:
        if fd is None:
            return False
        try:
            os.unlink(path.name, dir_fd=fd)
        except FileNotFoundError:
            return False
        return True


def create_empty(fd: int, name: str) -> None:
    """Make the empty file `name` in the directory open at `fd` if it is not there (a symbolic link there: ELOOP,
    never followed)."""
    os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                     dir_fd=fd))
