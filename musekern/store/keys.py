"""Cache keys: the named parts of a key, how a key is made from them, and one label spelling.

Pure stdlib: the runtime loader, prepare, doctor and the cache commands all key entries here, on
machines with no cutlass (the DSL version is read from package metadata, never by importing it).

A key is sha256 over the canonical JSON of its parts: kernel, variant params (fields at their
default are left out: a new lever does not move the keys of builds that do not use it), arch,
the sha256 of the files that define what the kernel compiles to, the DSL version and the ABI
version. Any change to any part gives a new key, never a stale hit.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .abi import ABI_VERSION

PART_NAMES = ("kernel", "variant", "arch", "source_sha256", "dsl_version", "abi_version")
DSL_DISTRIBUTION = "nvidia-cutlass-dsl"

_PKG = Path(__file__).resolve().parent.parent  # the musekern package directory: source files are named relative to it

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


def is_key(s) -> bool:
    return isinstance(s, str) and bool(_KEY_RE.match(s))


def canonical_json(obj) -> bytes:
    """The one JSON spelling used for keys and manifests (sorted keys, fixed separators)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def version_sort_key(v: str):
    """Order DSL versions numerically ("4.10.0" > "4.9.1"); text pieces sort before numbers."""
    return tuple((1, int(p), "") if p.isdigit() else (0, 0, p) for p in re.findall(r"\d+|[A-Za-z]+", v or ""))


def dist_version(dist: str) -> str | None:
    """An installed distribution's version from package metadata (imports nothing), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_version() -> str | None:
    """Installed nvidia-cutlass-dsl version (does not import cutlass); None where it is not installed."""
    return dist_version(DSL_DISTRIBUTION)


@functools.lru_cache(maxsize=None)
def source_hash(files: tuple[Path, ...]) -> str:
    """sha256 over the bytes of a kernel's source files, each named by its path in the package (read once per process:
    the installed sources do not change under a running process, and every key of every variant of a kernel needs
    it). The files are the variant's to name (`source_files()`); the store names no kernel."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).resolve().relative_to(_PKG).as_posix().encode() + b"\0" + Path(f).read_bytes() + b"\0")
    return h.hexdigest()


def variant_label(kernel: str, params: dict) -> str:
    """The one label spelling: `kernel[name=value,...]`, names sorted."""
    return f"{kernel}[{','.join(f'{k}={v}' for k, v in sorted(params.items()))}]"


def variant_tag(kernel: str, params: dict) -> str:
    """A short name of one variant (`v` + 12 hex of its label's sha256) that every kernel compiles into its entry
    symbol: the store refuses a cubin whose symbol lacks the key's tag, so a sibling variant's build (the same
    launch ABI, another meaning) is refused under a key even unsigned (store/variant_abi.py)."""
    return "v" + sha256_hex(variant_label(kernel, params).encode())[:12]


@dataclass(frozen=True)
class KeyParts:
    """The named inputs of a cache key. Changing any of them gives a new key (never a stale hit).

    `variant` is a sorted tuple of (name, value) pairs of the variant's `params()`, so the key
    does not depend on field order and `explain` can name the part that differs.
    """
    kernel: str
    variant: tuple
    arch: str
    source_sha256: str
    dsl_version: str
    abi_version: int

    @classmethod
    def make(cls, kernel: str, variant_params: dict, arch: str, source_sha256: str, dsl_version: str,
             abi_version: int) -> "KeyParts":
        for name, value in variant_params.items():
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                raise TypeError(f"variant param {name}={value!r} is not a JSON scalar")
        return cls(kernel=str(kernel), variant=tuple(sorted(variant_params.items())), arch=str(arch),
                   source_sha256=str(source_sha256), dsl_version=str(dsl_version), abi_version=int(abi_version))

    @property
    def variant_params(self) -> dict:
        return dict(self.variant)

    @property
    def label(self) -> str:
        return variant_label(self.kernel, self.variant_params)

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "variant": dict(self.variant), "arch": self.arch,
                "source_sha256": self.source_sha256, "dsl_version": self.dsl_version,
                "abi_version": self.abi_version}

    @classmethod
    def from_json(cls, d: dict) -> "KeyParts":
        if not isinstance(d, dict) or set(d) != set(PART_NAMES) or not isinstance(d["variant"], dict):
            raise ValueError(f"key parts must be an object with exactly {', '.join(PART_NAMES)}")
        return cls.make(d["kernel"], d["variant"], d["arch"], d["source_sha256"], d["dsl_version"],
                        d["abi_version"])

    def key(self) -> str:
        return sha256_hex(canonical_json(self.to_json()))

    def family(self) -> str:
        """The key of everything but the DSL version: entries the runtime may take for each other."""
        d = self.to_json()
        del d["dsl_version"]
        return sha256_hex(canonical_json(d))

    def differences(self, other: "KeyParts") -> list[str]:
        """Names of the parts that differ from `other`, in PART_NAMES order."""
        return [n for n in PART_NAMES if getattr(self, n) != getattr(other, n)]

    def describe_differences(self, other: "KeyParts") -> list[str]:
        """Human lines `part: wanted X, present Y` (variant params itemised)."""
        out = []
        for n in self.differences(other):
            if n == "variant":
                a, b = self.variant_params, other.variant_params
                for p in sorted(set(a) | set(b)):
                    if a.get(p, "<absent>") != b.get(p, "<absent>"):
                        out.append(f"variant.{p}: wanted {a.get(p, '<absent>')}, present {b.get(p, '<absent>')}")
            else:
                out.append(f"{n}: wanted {getattr(self, n)}, present {getattr(other, n)}")
        return out



def key_parts(variant, arch: str, dsl: str | None = None) -> KeyParts:
    """The named parts of the cache key of `variant` built for `arch` (a PlanEntry is accepted too). The variant
    names the source files its key hashes (`source_files()`).
    `dsl`: the DSL version the build is (or was) made with; "" where it is unknown (no DSL installed)."""
    variant = getattr(variant, "variant", variant)
    return KeyParts.make(kernel=variant.kernel, variant_params=variant.params(), arch=arch,
                         source_sha256=source_hash(tuple(variant.source_files())), dsl_version=dsl or "",
                         abi_version=ABI_VERSION)
