"""The store's errors: each message is one line saying what is wrong, on which path, and the command that
fixes it (the CLI prints it as `musekern: error: <message>`, exit 1)."""
from __future__ import annotations

from pathlib import Path

FIX_HINT = ("run `musekern verify --repair{cd}` to drop it, then `musekern prepare{cd}` "
            "(with your --model/--target) to rebuild it")


class CacheError(Exception):
    """Base class of cache errors; the message says what is wrong and how to fix it."""


class CorruptEntryError(CacheError):
    """A truncated, corrupted, edited or foreign entry: never loaded, treated as a miss by prepare."""

    def __init__(self, key: str, path: Path, problems: list[str], cache_dir: Path | None = None):
        self.key, self.path, self.problems = key, Path(path), list(problems)
        cd = f" --cache-dir {cache_dir}" if cache_dir is not None else ""
        super().__init__(f"corrupt cache entry {key[:16]} at {path}: {'; '.join(problems)}; "
                         + FIX_HINT.format(cd=cd))


class MissingEntryError(CacheError):
    """No committed entry under this key."""


class CacheAccessError(CacheError):
    """The cache directory, or a file in it, cannot be read or written as asked (not a directory, no
    permission, no space left, cannot be created); one line naming the path and the fix."""


class ReadOnlyCacheError(CacheAccessError):
    """A write was asked of a cache that cannot be written (image layer, chmod, ro mount)."""
