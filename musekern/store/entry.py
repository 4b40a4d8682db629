"""A cache entry as a reader sees it: `Entry` (the committed manifest, parsed; the cubin not read) and `Inspection`
(one checked read of an entry directory, store/cache.py's `Cache.inspect`)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from .errors import CacheError, CorruptEntryError
from .keys import KeyParts

CUBIN_NAME = "kernel.cubin"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class Entry:
    """A committed entry: its manifest parsed (not checked: see Cache.inspect); the cubin is not read."""
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
        except (ValueError, TypeError, KeyError, OverflowError) as e:
            raise CorruptEntryError(self.key, self.path, [f"bad key_parts: {e}"]) from None

    def _field(self, name: str) -> str:
        v = self.manifest.get(name)
        if v is None:
            kp = self.manifest.get("key_parts")
            v = kp.get(name) if isinstance(kp, dict) else None
        return "?" if v is None else str(v)

    @property
    def kernel(self) -> str:
        return self._field("kernel")

    @property
    def arch(self) -> str:
        return self._field("arch")

    @property
    def label(self) -> str:
        if isinstance(self.manifest.get("label"), str):
            return self.manifest["label"]
        try:
            return self.parts.label
        except CacheError:
            return "?"

    @property
    def dsl_version(self) -> str:
        return self._field("dsl_version")

    @property
    def size_bytes(self) -> int:
        """Bytes on disk (cubin + manifest); 0 for files that vanished meanwhile."""
        total = 0
        for p in (self.cubin_path, self.manifest_path):
            with contextlib.suppress(OSError):
                total += p.lstat().st_size
        return total

    def summary(self) -> dict:
        return {"key": self.key, "kernel": self.kernel, "arch": self.arch, "label": self.label,
                "dsl_version": self.dsl_version, "size_bytes": self.size_bytes, "path": str(self.path)}


@dataclass(frozen=True)
class Inspection:
    """One read of an entry directory. status: "sound" (entry and cubin set), "bad" (problems say why),
    "missing" (no entry dir) or "gone" (removed or replaced while it was read: a miss, not damage)."""
    key: str
    path: Path
    status: str
    entry: Entry | None = None
    cubin: bytes | None = None
    problems: tuple[str, ...] = ()
