"""Record folders other parts of musekern keep in the cache: a hook, because the store names no kernel and no GEMM.

A part that keeps records of its own under the cache (the GEMM tuning records, musekern/gemm/records.py) describes
its folder as a `RecordFolder` and the package layer registers a factory of it (`import musekern` does, as it does
the declared-ABI provider of store/variant_abi.py); the factory runs on first use, so `import musekern` imports
nothing of that part. The store's maintenance then treats each registered folder as its own:

- `clean` and every other maintenance command refuse a cache where a symbolic link or a file stands in its place
  (store/owndirs.py), and remove its killed writers' temp files (`clean_debris`);
- `clean --all` removes its records (`clear`; the dry run lists `files`);
- `stats` reports its `summary` under its `name`;
- while another process holds its writer lock (`lock`), its records and temp files stay, said in one line.

What the folder's records mean, how they are read (bounded) and written (under their lock) is the registering
part's business. Stdlib only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Callable

    from .cache import Cache

_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


@dataclass(frozen=True)
class RecordFolder:
    """One folder of records under the cache, and what the store's maintenance may ask of it."""
    name: str  # its key in `stats` (and `<name>_removed` in `clean --all --json`): "gemm_tuning"
    what: str  # how one line names one of its files: "GEMM tuning record"
    path: Callable[[Cache], Path]  # the folder: a directory of the cache's own (never a link)
    lock: Callable[[Cache], Path]  # the lock its writers hold while they write
    files: Callable[[Cache], list]  # the names `clear` would remove (a dry run's list)
    summary: Callable[[Cache], dict]  # for `stats` and `doctor`: JSON-ready, never raises
    clean_debris: Callable[[Cache, bool], int]  # killed writers' temp files removed (dry run: counted); how many
    clear: Callable[[Cache], list]  # every record removed, under its lock; the names removed

    def __post_init__(self):
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"not a record folder name: {self.name!r} (lower case, digits and _)")


_factories: list = []  # callables () -> RecordFolder, in registration order


def register(factory: Callable[[], RecordFolder]) -> None:
    """Add a record folder (the factory is called on first use; the same factory twice counts once)."""
    if factory not in _factories:
        _factories.append(factory)


def unregister(factory: Callable[[], RecordFolder]) -> None:
    if factory in _factories:
        _factories.remove(factory)


def folders() -> list[RecordFolder]:
    """Every registered folder; ValueError if two share a name (their stats would overwrite each other)."""
    out = [f() for f in _factories]
    names = [f.name for f in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"record folders registered twice under one name: {', '.join(dup)}")
    return out
