"""File primitives of the store: bounded reads of regular files, durable and atomic writes, removals that
never half-delete, and one-line descriptions of OSErrors (what failed, on which path, what fixes it)."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from pathlib import Path

# open flags of every read: never follow a symlink (the store writes none; a loop or a link to /dev/zero is
# damage), never block on a FIFO, never become a terminal's controlling process
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_CHUNK = 1 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))

# errno -> (what happened, what fixes it), for the one-line messages of reads and writes
_REASONS = {
    errno.EACCES: ("permission denied", "fix its permissions (chmod/chown) or use another --cache-dir"),
    errno.EPERM: ("operation not permitted", "fix its permissions (chmod/chown) or use another --cache-dir"),
    errno.EROFS: ("read-only file system", "remount it read-write or use another --cache-dir"),
    errno.ENOSPC: ("no space left on device", "free space there (e.g. `musekern gc --max-size SIZE`) or use "
                   "another --cache-dir"),
    errno.EDQUOT: ("disk quota exceeded", "free space there (e.g. `musekern gc --max-size SIZE`) or use another "
                   "--cache-dir"),
    errno.ENOTDIR: ("a part of the path is not a directory", "point --cache-dir / MUSEKERN_CACHE_DIR at a directory"),
    errno.ELOOP: ("a symbolic link (or a loop of them)", "remove it: the store holds regular files only"),
    errno.EIO: ("I/O error", "check the disk (dmesg), then `musekern verify --repair`"),
    errno.ENAMETOOLONG: ("file name too long", "use a shorter --cache-dir"),
    errno.EMFILE: ("too many open files", "raise the open-file limit (ulimit -n)"),
    errno.ENOENT: ("no such file or directory", "check the path"),
}


class ReadProblem(Exception):
    """A file that cannot be read as a regular file within its size limit; str(e) is one line naming it and the
    store's fix, `reason` what is wrong alone (for a caller that names the file and the fix its own way)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


def reason(e: OSError) -> str:
    return _REASONS.get(e.errno, (e.strerror or type(e).__name__,))[0] if e.errno else (e.strerror or str(e))


def fix_for(e: OSError) -> str:
    return _REASONS.get(e.errno, ("", "check the path and its permissions, or use another --cache-dir"))[1]


def describe(e: OSError, path, doing: str = "") -> str:
    """One line: `<doing> <path>: <reason>; <fix>`."""
    head = f"{doing} {path}" if doing else str(path)
    return f"{head}: {reason(e)}; {fix_for(e)}"


def read_regular(path, limit: int, dir_fd: int | None = None, shown=None, follow_symlinks: bool = False,
                 fix: str = "; remove it (`musekern verify --repair`)") -> bytes:
    """The bytes of regular file `path` (relative to `dir_fd` if given), at most `limit` of them.

    Raises FileNotFoundError when it does not exist (the caller decides what a missing file means) and
    ReadProblem (one line naming `shown`, default `path`) for a directory, FIFO, device, socket, symlink or
    symlink loop, a file larger than `limit`, or any other OSError. Never blocks on a FIFO, never reads more
    than `limit` + 1 bytes. `follow_symlinks` is for a file the user names (a model config in the HF hub cache is
    a symlink); what it points at must still be a regular file. `fix` ends the message for a file that is not
    regular."""
    shown = path if shown is None else shown
    try:
        fd = os.open(path, _READ_FLAGS & ~os.O_NOFOLLOW if follow_symlinks else _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ReadProblem(describe(e, shown), reason(e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise ReadProblem(f"{shown} is {kind}, not a regular file{fix}", f"is {kind}, not a regular file")
        if st.st_size > limit:
            why = f"is {st.st_size} bytes, more than the {limit} it may hold"
            raise ReadProblem(f"{shown} {why}", why)
        buf = bytearray()
        while len(buf) <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - len(buf)))
            if not chunk:
                break
            buf += chunk
        if len(buf) > limit:
            why = f"grew past the {limit} bytes it may hold while it was read"
            raise ReadProblem(f"{shown} {why}", why)
        return bytes(buf)
    except OSError as e:
        raise ReadProblem(describe(e, shown), reason(e)) from None
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
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


def write_new_file(path: Path, data: bytes, mode: int = 0o444) -> None:
    """Create `path` (it must not exist), write `data`, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `path` via a temp file in the same dir + fsync + rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write_new_file(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def rmtree(path: Path) -> None:
    """Remove a tree, or a file or symlink (never what a symlink points at); a missing path is fine."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
    except FileNotFoundError:
        return
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)
