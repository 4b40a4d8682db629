"""Bundles: a tar of cache entries that moves a warmed cache between machines.

    musekern-bundle.json                 index: format, entries (key, label, hashes), optional plan
    entries/<key>/manifest.json          canonical manifest bytes
    entries/<key>/kernel.cubin

Relocatable: member names are relative and no absolute path is stored anywhere (manifests
hold none). Reproducible: the same entries give byte-identical bundles on any machine:
members sorted by key, fixed mtime (0), owner (0/0, no names), modes (0644), USTAR format
(no PAX timestamps), manifests re-serialised canonically, and for `.tar.gz` a gzip header
with mtime 0 and no file name. Verified on import: every member header is checked (name whitelist,
regular files only, per-member size caps, a cap on the total of all sizes, no duplicates) before
anything enters the cache, and each entry gets every check `Cache.load` applies (store/manifest.py)
plus the index's hashes; a bad path (traversal, absolute, link, device) or a bundle too large in
total rejects the whole bundle, a bad entry is rejected on its own and reported, and an entry the
cache cannot store (disk full) is reported as failed. Memory holds one entry at a time.
"""
from __future__ import annotations

import gzip
import io
import lzma
import os
import re
import tarfile
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from . import fs, hygiene
from .cache import CACHE_FORMAT, CUBIN_NAME, MANIFEST_NAME, Cache, CacheError, ReadOnlyCacheError, manifest_bytes
from .keys import KeyParts, is_key, sha256_hex
from .manifest import MAX_CUBIN_BYTES, MAX_MANIFEST_BYTES, check, cubin_problems, parse_json

INDEX_NAME = "musekern-bundle.json"
BUNDLE_FORMAT = 1
MAX_INDEX_BYTES = 64 << 20
MAX_BUNDLE_BYTES = 1 << 30  # the sum of the members' sizes; cubins are 10-500 KB, a full plan a few MB
MAX_MEMBERS = 100_000
_MEMBER_RE = re.compile(r"^entries/([0-9a-f]{64})/(manifest\.json|kernel\.cubin)$")


class BundleError(CacheError):
    """The bundle as a whole cannot be trusted or read (nothing was imported)."""


@dataclass
class ImportReport:
    added: list = field(default_factory=list)  # keys newly stored
    present: list = field(default_factory=list)  # keys the cache already had (sound)
    rejected: list = field(default_factory=list)  # (key, reason): the bundle's entry is bad
    failed: list = field(default_factory=list)  # (key, reason): a sound entry this cache could not store
    plan: str | None = None  # plan name recorded from the bundle, if any

    @property
    def ok(self) -> bool:
        return not self.rejected and not self.failed

    def to_json(self) -> dict:
        return {"ok": self.ok, "added": self.added, "present": self.present,
                "rejected": [{"key": k, "reason": r} for k, r in self.rejected],
                "failed": [{"key": k, "reason": r} for k, r in self.failed], "plan": self.plan}


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


class _Bad(Exception):
    """The bundle as a whole is unsafe (raised inside the scan, turned into BundleError)."""


def _open_tar(path: Path):
    try:
        return tarfile.open(path, mode="r:*")
    except FileNotFoundError:
        raise BundleError(f"{path}: no such bundle") from None
    except OSError as e:
        raise BundleError(f"{path}: cannot read it ({fs.reason(e)}); {fs.fix_for(e)}") from None
    except (tarfile.TarError, EOFError, lzma.LZMAError, zlib.error) as e:
        raise BundleError(f"{path}: not a readable bundle ({e}); re-export it with `musekern export`") from None


def _limit(name: str) -> int:
    if name == INDEX_NAME:
        return MAX_INDEX_BYTES
    return MAX_MANIFEST_BYTES if name.endswith(MANIFEST_NAME) else MAX_CUBIN_BYTES


def _members(path: Path, read):
    """(name, bytes or None) of every member in order, after checking each header: a known name, a regular
    file, within its size limit, not twice, and the running total of sizes within MAX_BUNDLE_BYTES. Checked
    from the headers before any data is read, so a decompression bomb is refused before it is decompressed
    and memory stays bounded by one member. `read(name, size)` says which members' bytes to read (the others
    give None); read=False walks the headers only."""
    seen, total = set(), 0
    with _open_tar(path) as tar:
        try:
            for n, ti in enumerate(tar):
                name = ti.name
                if n >= MAX_MEMBERS:
                    raise _Bad(f"more than {MAX_MEMBERS} members")
                if name != INDEX_NAME and not _MEMBER_RE.match(name):
                    # catches ../x, /abs, entries/<key>/../../x, stray files
                    raise _Bad(f"unexpected member {name!r} (path traversal or not a musekern bundle); nothing "
                               "was imported")
                if not ti.isreg():
                    raise _Bad(f"member {name!r} is not a regular file (link or device); nothing was imported")
                if ti.size > _limit(name):
                    raise _Bad(f"member {name!r} is {ti.size} bytes (limit {_limit(name)}); nothing was imported")
                if name in seen:
                    raise _Bad(f"member {name!r} appears twice; nothing was imported")
                if n == 0 and name != INDEX_NAME:
                    raise _Bad(f"the first member is not {INDEX_NAME}; not a musekern bundle")
                seen.add(name)
                total += ti.size
                if total > MAX_BUNDLE_BYTES:
                    raise _Bad(f"members total more than {MAX_BUNDLE_BYTES} bytes (a decompression bomb?); "
                               "nothing was imported")
                if read and read(name, ti.size):
                    f = tar.extractfile(ti)
                    data = f.read(ti.size + 1) if f else b""
                    if len(data) != ti.size:
                        raise _Bad(f"member {name!r} is not the {ti.size} bytes its header says")
                    yield name, data
                else:
                    yield name, None
        except _Bad as e:
            raise BundleError(f"{path}: {e}") from None
        except (OSError, tarfile.TarError, EOFError, lzma.LZMAError, zlib.error) as e:
            raise BundleError(f"{path}: truncated or damaged bundle ({e}); "
                              "re-export it with `musekern export`") from None


def _check_entry(key: str, meta, mbytes: bytes | None, cubin: bytes | None):
    """(parts, cubin, manifest) of a sound bundle entry, else raise ValueError(reason). The manifest gets every
    check `Cache.load` applies (store/manifest.py: digest, key, ABI, the cubin's hash and ELF)."""
    if not isinstance(meta, dict):
        raise ValueError("bundle index entry is not an object")
    if mbytes is None or cubin is None:
        raise ValueError("manifest.json or kernel.cubin missing from the bundle, or not the size its index says")
    if sha256_hex(mbytes) != meta.get("manifest_sha256"):
        raise ValueError("manifest.json does not match the bundle index (corrupted)")
    if sha256_hex(cubin) != meta.get("cubin_sha256") or len(cubin) != meta.get("cubin_size"):
        raise ValueError("kernel.cubin does not match the bundle index (corrupted or truncated)")
    manifest = parse_json(mbytes, "manifest.json")
    problems = check(manifest, key, mbytes)
    if not problems:
        problems = cubin_problems(manifest, cubin)
    if problems:
        raise ValueError("; ".join(problems))
    return KeyParts.from_json(manifest["key_parts"]), cubin, manifest


def _index(path: Path, raw: bytes) -> tuple[dict, dict]:
    """(index, key -> index entry) of the bundle's index member."""
    try:
        index = parse_json(raw, INDEX_NAME)
        if not isinstance(index, dict) or not isinstance(index.get("entries"), list):
            raise ValueError("it has no list of entries")
        metas = {}
        for e in index["entries"]:
            k = e.get("key") if isinstance(e, dict) else None
            metas[k if isinstance(k, str) else repr(k)] = e
    except ValueError as e:
        raise BundleError(f"{path}: bad {INDEX_NAME} ({e}); re-export it with `musekern export`") from None
    if index.get("bundle_format") != BUNDLE_FORMAT or type(index.get("bundle_format")) is not int:
        raise BundleError(f"{path}: bundle format {str(index.get('bundle_format'))[:20]!r} is not {BUNDLE_FORMAT}; "
                          "export it again with this musekern version")
    return index, metas


def import_bundle(cache: Cache, path: Path | str) -> ImportReport:
    """Verify every member of the bundle at `path`, then store the sound entries in `cache`.

    Raises BundleError (nothing imported) for an unreadable bundle, an unsafe member, or one too large in
    total; ReadOnlyCacheError / CacheAccessError when the cache cannot be written at all. A bad entry is
    listed in `report.rejected`, one that could not be written (disk full) in `report.failed`; the others are
    imported. Memory holds one entry at a time.
    """
    path = Path(path)
    names = [name for name, _ in _members(path, False)]  # every header checked before anything is stored
    if not names or names[0] != INDEX_NAME:
        raise BundleError(f"{path}: no {INDEX_NAME}; not a musekern bundle")
    keys_in_tar = {m.group(1) for m in map(_MEMBER_RE.match, names) if m}
    report = ImportReport()
    pending: dict[str, dict] = {}  # key -> the members read so far
    metas: dict = {}
    index: dict = {}

    def finish(key: str) -> None:
        got = pending.pop(key)
        if key not in metas:
            report.rejected.append((key, "entry files not listed in the bundle index"))
            return
        try:
            parts, cubin, manifest = _check_entry(key, metas[key], got.get(MANIFEST_NAME), got.get(CUBIN_NAME))
        except (ValueError, TypeError, KeyError) as e:
            report.rejected.append((key, str(e)))
            return
        if cache.sound(key) is not None:
            report.present.append(key)
            return
        try:
            cache.put(parts, cubin, manifest, command="import")
        except ValueError as e:  # anything else Cache.put refuses: this entry is rejected, the import goes on
            report.rejected.append((key, str(e)))
            return
        except ReadOnlyCacheError:
            raise
        except CacheError as e:  # disk full, I/O error: this entry is not stored, nothing torn
            report.failed.append((key, str(e)))
            return
        report.added.append(key)

    def wanted(name: str, size: int) -> bool:
        """Read the index, and an entry's files only when the index lists them at that size (a lying header
        or a stray entry is rejected without its bytes in memory)."""
        if name == INDEX_NAME:
            return True
        key, file = _MEMBER_RE.match(name).groups()
        meta = metas.get(key)
        return isinstance(meta, dict) and (file == MANIFEST_NAME or meta.get("cubin_size") == size)

    for name, data in _members(path, wanted):
        if name == INDEX_NAME:
            index, metas = _index(path, data)
            for k in sorted(metas):  # a key that is not one (a number, junk) is rejected, never a crash
                if not is_key(k):
                    report.rejected.append((k, "not a cache key"))
            if any(is_key(k) for k in metas) or index.get("plan"):
                cache.require_writable(f"import {path.name}", "import")
            continue
        key, file = _MEMBER_RE.match(name).groups()
        pending.setdefault(key, {})[file] = data
        if len(pending[key]) == 2:
            finish(key)
    for key in sorted(pending):
        finish(key)
    for key in sorted(k for k in metas if is_key(k) and k not in keys_in_tar):
        report.rejected.append((key, "listed in the bundle index but its files are missing"))
    if index.get("plan") and report.ok:
        hygiene.record_plan(cache, str(index["plan"]), [k for k in metas if is_key(k)])
        report.plan = str(index["plan"])
    return report
