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
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

_held_lock = threading.Lock()
_held: dict[tuple[str, int], list] = {}  # (lock path, thread) -> [fd, depth]: flock is not reentrant


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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        raise on_error(e, path) from None
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
