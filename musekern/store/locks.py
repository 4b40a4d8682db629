"""Per-key file locks (flock): exclusive for writers and maintenance, a non-blocking try for maintenance, and
a probe that writes nothing (stats on a read-only cache).

flock locks belong to an open file description, so two opens in one process exclude each other like two
processes do; a registry makes the lock reentrant within one thread (`obtain` holds it while `put` runs).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from .errors import CacheAccessError

_held_lock = threading.Lock()
_held: dict[tuple[str, int], list] = {}  # (lock path, thread) -> [fd, depth]: flock is not reentrant
_NOT_A_FILE = (errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.ETXTBSY)


class LockFileError(CacheAccessError):
    """A lock file that is a directory, a symbolic link, a FIFO or a device: no lock can be taken with it, and
    maintenance skips its key (one line: the path and the fix)."""

    def __init__(self, path: Path, kind: str):
        self.path = path
        super().__init__(f"{path} is {kind}, not a lock file: remove it (`rm -r {path}`; musekern makes a new one)")


def _not_a_lock(path: Path, fd: int | None = None, e: OSError | None = None) -> LockFileError | None:
    """LockFileError when `path` (open at `fd`, or failed to open with `e`) is no regular file, else None."""
    try:
        st = os.fstat(fd) if fd is not None else os.lstat(path)
    except OSError:
        return LockFileError(path, "not a regular file") if e is not None and e.errno in _NOT_A_FILE else None
    if stat.S_ISREG(st.st_mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
    return LockFileError(path, kind)


@contextlib.contextmanager
def held(path: Path, wait: bool, on_error: Callable[[OSError, Path], Exception],
         timeout: float | None = None) -> Iterator[bool]:
    """Hold the lock file `path` (created if needed) exclusively; yields True. With wait=False yields False at
    once when another holder has it; with a `timeout` (seconds), False once it has waited that long. `on_error(e,
    path)` makes the exception for a lock file that cannot be opened (read-only, disk full)."""
    me = (str(path), threading.get_ident())
    with _held_lock:
        mine = _held.get(me)
        if mine:
            mine[1] += 1
    if mine:
        try:
            yield True
        finally:
            with _held_lock:
                mine[1] -= 1
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        raise (_not_a_lock(path, e=e) or on_error(e, path)) from None
    bad = _not_a_lock(path, fd)
    if bad is not None:
        os.close(fd)
        raise bad
    try:
        try:
            _take(fd, wait, timeout)
            locked = True
        except BlockingIOError:
            yield False
            return
        except OSError as e:
            # NFS mounted with `nolock` (or a filesystem without locks): go on unlocked. Entries stay whole
            # (atomic dir rename, first writer wins); the cost is a possible duplicate build, and maintenance
            # beside live writers is not safe there.
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            locked = False
        with _held_lock:
            _held[me] = [fd, 1]
        try:
            yield True
        finally:
            with _held_lock:
                _held.pop(me, None)
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _take(fd: int, wait: bool, timeout: float | None) -> None:
    """flock(LOCK_EX) on fd: blocking (wait, no timeout), one try (not wait), or tries until `timeout` seconds have
    passed; BlockingIOError when it was not taken."""
    if not wait or timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def is_held(path: Path) -> bool:
    """Whether someone holds the lock file `path` now (this thread included). Opens it read-only if it
    exists; creates and writes nothing."""
    with _held_lock:
        if (str(path), threading.get_ident()) in _held:
            return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
