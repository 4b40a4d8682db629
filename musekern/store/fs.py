"""File primitives of the store: durable writes, atomic replaces, removals that never half-delete."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path


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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
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
    shutil.rmtree(path, ignore_errors=True)
