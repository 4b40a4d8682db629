"""Bundles: a tar of cache entries that moves a warmed cache between machines.

    musekern-bundle.json                 index: format, entries (key, label, hashes), optional plan
    entries/<key>/manifest.json          canonical manifest bytes
    entries/<key>/kernel.cubin

Relocatable: member names are relative and no absolute path is stored anywhere (manifests
hold none). Reproducible: the same entries give byte-identical bundles on any machine:
members sorted by key, fixed mtime (0), owner (0/0, no names), modes (0644), USTAR format
(no PAX timestamps), manifests re-serialised canonically, and for `.tar.gz` a gzip header
with mtime 0 and no file name. Verified on import: every member is checked (name whitelist,
regular files only, size, sha256 against the index and the manifest, manifest against its
key) before anything enters the cache; a bad path (traversal, absolute, link, device)
rejects the whole bundle, a bad entry is rejected on its own and reported.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import re
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import hygiene
from .cache import CACHE_FORMAT, CUBIN_NAME, MANIFEST_NAME, Cache, CacheError, manifest_bytes
from .keys import KeyParts, is_key, sha256_hex

INDEX_NAME = "musekern-bundle.json"
BUNDLE_FORMAT = 1
MAX_MEMBER_BYTES = 256 << 20
MAX_MEMBERS = 100_000
_MEMBER_RE = re.compile(r"^entries/([0-9a-f]{64})/(manifest\.json|kernel\.cubin)$")


class BundleError(CacheError):
    """The bundle as a whole cannot be trusted or read (nothing was imported)."""


@dataclass
class ImportReport:
    added: list = field(default_factory=list)  # keys newly stored
    present: list = field(default_factory=list)  # keys the cache already had (sound)
    rejected: list = field(default_factory=list)  # (key, reason)
    plan: str | None = None  # plan name recorded from the bundle, if any

    @property
    def ok(self) -> bool:
        return not self.rejected

    def to_json(self) -> dict:
        return {"ok": self.ok, "added": self.added, "present": self.present,
                "rejected": [{"key": k, "reason": r} for k, r in self.rejected], "plan": self.plan}


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.type = size, 0, 0o644, tarfile.REGTYPE
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def export_bundle(cache: Cache, keys, out_path: Path | str, plan_name: str | None = None) -> dict:
    """Write the entries `keys` of `cache` to `out_path` (.tar, or .tar.gz/.tgz); returns the index.

    Every entry is verified first (CacheError naming the bad one: a damaged entry is never
    exported). With `plan_name`, import records the bundle's keys as that plan (clean --stale).
    The file appears atomically (temp + rename), so a failed export leaves no half bundle.
    """
    keys = sorted(set(keys))
    members = []
    index_entries = []
    for key in keys:
        entry, cubin = cache.load(key)  # MissingEntryError / CorruptEntryError name the entry
        mbytes = manifest_bytes(entry.manifest)
        members.append((f"entries/{key}/{MANIFEST_NAME}", mbytes))
        members.append((f"entries/{key}/{CUBIN_NAME}", cubin))
        index_entries.append({"key": key, "kernel": entry.kernel, "arch": entry.arch, "label": entry.label,
                              "manifest_sha256": sha256_hex(mbytes), "cubin_sha256": sha256_hex(cubin),
                              "cubin_size": len(cubin)})
    index = {"bundle_format": BUNDLE_FORMAT, "cache_format": CACHE_FORMAT, "entries": index_entries}
    if plan_name:
        index["plan"] = plan_name
    ibytes = manifest_bytes(index)

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [(INDEX_NAME, ibytes)] + members:
            tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
    data = buf.getvalue()
    out = Path(out_path)
    if out.name.endswith((".tar.gz", ".tgz")):
        gz = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=gz, mtime=0, compresslevel=9) as f:
            f.write(data)
        data = gz.getvalue()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return index


def _read_members(path: Path) -> dict[str, bytes]:
    """name -> bytes of every member, after checking names and types (no extraction to disk)."""
    try:
        tar = tarfile.open(path, mode="r:*")
    except (OSError, tarfile.TarError) as e:
        raise BundleError(f"{path}: not a readable bundle ({e}); re-export it with `musekern export`") from None
    members: dict[str, bytes] = {}
    with tar:
        try:
            for n, ti in enumerate(tar):
                if n >= MAX_MEMBERS:
                    raise BundleError(f"{path}: more than {MAX_MEMBERS} members")
                name = ti.name
                if name != INDEX_NAME and not _MEMBER_RE.match(name):
                    # catches ../x, /abs, entries/<key>/../../x, stray files
                    raise BundleError(f"{path}: unexpected member {name!r} (path traversal or not a musekern "
                                      "bundle); nothing was imported")
                if not ti.isreg():
                    raise BundleError(f"{path}: member {name!r} is not a regular file (link or device); "
                                      "nothing was imported")
                if ti.size > MAX_MEMBER_BYTES:
                    raise BundleError(f"{path}: member {name!r} is {ti.size} bytes (limit {MAX_MEMBER_BYTES})")
                if name in members:
                    raise BundleError(f"{path}: member {name!r} appears twice; nothing was imported")
                f = tar.extractfile(ti)
                members[name] = f.read() if f else b""
        except (OSError, tarfile.TarError, EOFError) as e:
            raise BundleError(f"{path}: truncated or damaged bundle ({e}); "
                              "re-export it with `musekern export`") from None
    return members


def _check_entry(key: str, meta: dict, mbytes: bytes | None, cubin: bytes | None):
    """(parts, cubin, manifest) of a sound bundle entry, else raise ValueError(reason)."""
    if mbytes is None or cubin is None:
        raise ValueError("manifest.json or kernel.cubin missing from the bundle")
    if sha256_hex(mbytes) != meta.get("manifest_sha256"):
        raise ValueError("manifest.json does not match the bundle index (corrupted)")
    if sha256_hex(cubin) != meta.get("cubin_sha256") or len(cubin) != meta.get("cubin_size"):
        raise ValueError("kernel.cubin does not match the bundle index (corrupted or truncated)")
    try:
        manifest = json.loads(mbytes)
    except ValueError as e:
        raise ValueError(f"manifest.json is not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ValueError("manifest.json is not a JSON object")
    parts = KeyParts.from_json(manifest.get("key_parts"))
    if parts.key() != key or manifest.get("key") != key:
        raise ValueError("foreign entry: the manifest belongs to another key")
    if manifest.get("format") != CACHE_FORMAT:
        raise ValueError(f"cache format {manifest.get('format')!r} != {CACHE_FORMAT}")
    if manifest.get("cubin_sha256") != sha256_hex(cubin) or manifest.get("cubin_size") != len(cubin):
        raise ValueError("kernel.cubin does not match its manifest's sha256/size")
    for name in ("kernel", "arch"):  # what Cache.put would refuse: reject it here, entry by entry
        if manifest.get(name) != getattr(parts, name):
            raise ValueError(f"manifest {name} {manifest.get(name)!r} != key part {getattr(parts, name)!r}")
    return parts, cubin, manifest


def import_bundle(cache: Cache, path: Path | str) -> ImportReport:
    """Verify every member of the bundle at `path`, then store the sound entries in `cache`.

    Raises BundleError (nothing imported) for an unreadable bundle or an unsafe member name;
    ReadOnlyCacheError when the cache cannot be written. Bad entries are listed in
    `report.rejected`; the others are imported.
    """
    path = Path(path)
    members = _read_members(path)
    if INDEX_NAME not in members:
        raise BundleError(f"{path}: no {INDEX_NAME}; not a musekern bundle")
    try:
        index = json.loads(members[INDEX_NAME])
        metas = {e["key"]: e for e in index["entries"]}
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{path}: bad {INDEX_NAME} ({e})") from None
    if index.get("bundle_format") != BUNDLE_FORMAT:
        raise BundleError(f"{path}: bundle format {index.get('bundle_format')!r} is not {BUNDLE_FORMAT}; "
                          "export it again with this musekern version")
    keys_in_tar = {m.group(1) for m in map(_MEMBER_RE.match, members) if m}
    report = ImportReport()
    for key in sorted(keys_in_tar - set(metas)):
        report.rejected.append((key, "entry files not listed in the bundle index"))

    good = []
    for key in sorted(metas, key=str):  # a non-string key is rejected below, not a crash here
        if not is_key(key):
            report.rejected.append((str(key), "not a cache key"))
            continue
        try:
            good.append(_check_entry(key, metas[key], members.get(f"entries/{key}/{MANIFEST_NAME}"),
                                     members.get(f"entries/{key}/{CUBIN_NAME}")))
        except (ValueError, TypeError, KeyError) as e:
            report.rejected.append((key, str(e)))

    if good or index.get("plan"):
        cache.require_writable(f"import {path.name}")
    for parts, cubin, manifest in good:
        key = parts.key()
        if cache.sound(key) is not None:
            report.present.append(key)
            continue
        try:
            cache.put(parts, cubin, manifest)
        except ValueError as e:  # anything else Cache.put refuses: this entry is rejected, the import goes on
            report.rejected.append((key, str(e)))
            continue
        report.added.append(key)
    if index.get("plan") and not report.rejected:
        hygiene.record_plan(cache, str(index["plan"]), list(metas))
        report.plan = str(index["plan"])
    return report
