"""Bundles: a tar of cache entries that moves a warmed cache between machines.

    musekern-bundle.json                 index: format, entries (key, label, hashes), optional plan
    entries/<key>/manifest.json          canonical manifest bytes
    entries/<key>/kernel.cubin

Relocatable: member names are relative and no absolute path is stored anywhere (manifests
hold none). Reproducible: the same entries give byte-identical bundles on any machine:
members sorted by key, fixed mtime (0), owner (0/0, no names), modes (0644), USTAR format
(no PAX timestamps), manifests re-serialised canonically, and for `.tar.gz` a gzip header
with mtime 0 and no file name. Verified on import: every member header is read by a bounded reader
(store/tarread.py: PAX and GNU long-name headers capped before they are read) and checked (name whitelist,
regular files only, per-member size caps, a cap on the total of all sizes, no duplicates) before
anything enters the cache; the index is parsed with caps on its size, values and entries; and each entry
gets every check `Cache.load` applies (store/manifest.py) plus the index's hashes, and, on a machine that
trusts keys, a signature check (store/signing.py). A bad path (traversal, absolute, link, device) or a
bundle too large in total rejects the whole bundle, a bad entry is rejected on its own and reported, and an
entry the cache cannot store (disk full) is reported as failed. A GNU tar re-pack of an extracted bundle
(`tar -cf b.tar -C dir .`: leading ./, folder members, any order) is read as the bundle it holds. Memory
holds one entry at a time.
"""
from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import fs, hygiene, tarread
from .cache import CACHE_FORMAT, CUBIN_NAME, MANIFEST_NAME, Cache, CacheError, ReadOnlyCacheError, manifest_bytes
from .keys import KeyParts, is_key, sha256_hex
from .manifest import MAX_CUBIN_BYTES, MAX_JSON_ITEMS, MAX_MANIFEST_BYTES, check, cubin_problems, parse_json
from .signing import SecretKey, TrustedKeys, sign_manifest

INDEX_NAME = "musekern-bundle.json"
BUNDLE_FORMAT = 1
MAX_INDEX_ENTRIES = 8192  # a plan is 50-200 entries per target
MAX_INDEX_BYTES = 4 << 20  # an index entry is ~420 bytes
MAX_INDEX_ITEMS = 32 * MAX_INDEX_ENTRIES  # objects, arrays and commas: ~20 per entry (labels hold commas)
MAX_BUNDLE_BYTES = 1 << 30  # the sum of the members' sizes; cubins are 10-500 KB, a full plan a few MB
MAX_MEMBERS = 4 * MAX_INDEX_ENTRIES  # two files per entry, the folders a GNU tar re-pack adds
SUFFIXES = {".tar": "", ".tar.gz": "gz", ".tgz": "gz"}  # what export writes, by the output's name
_MEMBER_RE = re.compile(r"^entries/([0-9a-f]{64})/(manifest\.json|kernel\.cubin)$")
_DIR_RE = re.compile(r"^(?:\.?|entries|entries/[0-9a-f]{64})/?$")


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


def bundle_compression(out_path: Path | str) -> str:
    """"" (plain tar) or "gz", from the output's name; BundleError (one line) for any other name (a `.zip` that
    would hold a tar)."""
    name = Path(out_path).name
    for suffix, comp in SUFFIXES.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            return comp
    raise BundleError(f"{str(out_path)[:200]}: a bundle is written as {', '.join(SUFFIXES)}; name the output so "
                      "(e.g. -o bundle.tar.gz)")


def export_bundle(cache: Cache, keys, out_path: Path | str, plan_name: str | None = None,
                  sign: SecretKey | None = None) -> dict:
    """Write the entries `keys` of `cache` to `out_path` (.tar, or .tar.gz/.tgz); returns the index.

    Every entry is verified first (CacheError naming the bad one: a damaged entry is never
    exported). With `plan_name`, import records the bundle's keys as that plan (clean --stale).
    With `sign`, each exported manifest carries that key's signature (store/signing.py; ed25519 is
    deterministic, so the bundle stays reproducible). The file appears atomically (temp + rename), so a
    failed export leaves no half bundle.
    """
    compression = bundle_compression(out_path)
    keys = sorted(set(keys))
    members = []
    index_entries = []
    for key in keys:
        entry, cubin = cache.load(key)  # MissingEntryError / CorruptEntryError name the entry
        mbytes = manifest_bytes(sign_manifest(entry.manifest, sign))
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
    if compression == "gz":
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


def _limit(name: str) -> int:
    if name == INDEX_NAME:
        return MAX_INDEX_BYTES
    return MAX_MANIFEST_BYTES if name.endswith(MANIFEST_NAME) else MAX_CUBIN_BYTES


def _normal(name: str) -> str:
    """A member name as GNU tar re-packs it (`tar -cf b.tar -C dir .`: a leading ./), made plain."""
    while name.startswith("./"):
        name = name[2:]
    return name


def _open(path: Path):
    """The bundle open for reading: a regular file (a FIFO, a device or /dev/zero is refused, never read or
    waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BundleError(f"{path}: no such bundle") from None
    except OSError as e:
        raise BundleError(f"{path}: cannot read it ({fs.reason(e)}); {fs.fix_for(e)}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BundleError(f"{path}: not a regular file (a directory, device or FIFO); give the bundle file "
                          "`musekern export` wrote")
    return os.fdopen(fd, "rb")


def _walk(path: Path, f, read):
    """(name, bytes or None) of every file member in order, after checking each header (store/tarread.py reads
    them bounded): a known name (a leading ./ is fine), a regular file or one of the bundle's own directories,
    within its size limit, not twice, and the running total of sizes within MAX_BUNDLE_BYTES. Checked from the
    headers before any data is read, so a bomb is refused before it is decompressed and memory stays bounded
    by one member. `read(name, size)` says which members' bytes to read (the others give None)."""
    seen, total = set(), 0
    try:
        f.seek(0)
        reader = tarread.Reader(tarread.open_stream(f))
        for n, m in enumerate(reader.members()):
            if n >= MAX_MEMBERS:
                raise _Bad(f"more than {MAX_MEMBERS} members")
            name = _normal(m.name)
            if m.kind == "dir" and _DIR_RE.match(name):
                continue  # GNU tar's re-pack lists the folders too
            shown = tarread.show(m.name)
            if m.kind == "link":
                raise _Bad(f"member {shown} is a link, not a regular file; nothing was imported")
            if m.kind != "file":
                raise _Bad(f"member {shown} is not a regular file (a device, FIFO or unknown kind); nothing was "
                           "imported")
            if name != INDEX_NAME and not _MEMBER_RE.match(name):
                # catches ../x, /abs, entries/<key>/../../x, stray files
                raise _Bad(f"unexpected member {shown} (path traversal or not a musekern bundle); nothing was "
                           "imported")
            if m.size > _limit(name):
                raise _Bad(f"member {shown} is {m.size} bytes (limit {_limit(name)}); nothing was imported")
            if name in seen:
                raise _Bad(f"member {shown} appears twice; nothing was imported")
            seen.add(name)
            total += m.size
            if total > MAX_BUNDLE_BYTES:
                raise _Bad(f"members total more than {MAX_BUNDLE_BYTES} bytes (a decompression bomb?); "
                           "nothing was imported")
            yield name, (reader.read(m.size) if read(name, m.size) else None)
    except _Bad as e:
        raise BundleError(f"{path}: {str(e)[:400]}") from None
    except tarread.TarProblem as e:
        raise BundleError(f"{path}: {str(e)[:300]}; not a bundle `musekern export` wrote, or a damaged one: "
                          "export it again") from None
    except tarread.read_errors() as e:
        raise BundleError(f"{path}: truncated or damaged bundle ({str(e)[:200]}); "
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
    manifest = parse_json(mbytes, "manifest.json", max_items=MAX_JSON_ITEMS)
    problems = check(manifest, key, mbytes)
    if not problems:
        problems = cubin_problems(manifest, cubin)
    if problems:
        raise ValueError("; ".join(problems))
    return KeyParts.from_json(manifest["key_parts"]), cubin, manifest


def _index(path: Path, raw: bytes) -> tuple[dict, dict]:
    """(index, key -> index entry) of the bundle's index member: parsed with a cap on the values it holds (checked
    before parsing: an index of millions of empty objects is refused, not built) and on its entries."""
    try:
        index = parse_json(raw, INDEX_NAME, max_items=MAX_INDEX_ITEMS)
        if not isinstance(index, dict) or not isinstance(index.get("entries"), list):
            raise ValueError("it has no list of entries")
        if len(index["entries"]) > MAX_INDEX_ENTRIES:
            raise ValueError(f"it lists {len(index['entries'])} entries, more than {MAX_INDEX_ENTRIES}")
        metas = {}
        for e in index["entries"]:
            k = e.get("key") if isinstance(e, dict) else None
            metas[k if isinstance(k, str) else repr(k)[:80]] = e
    except ValueError as e:
        raise BundleError(f"{path}: bad {INDEX_NAME} ({str(e)[:200]}); re-export it with `musekern export`") from None
    if index.get("bundle_format") != BUNDLE_FORMAT or type(index.get("bundle_format")) is not int:
        raise BundleError(f"{path}: bundle format {str(index.get('bundle_format'))[:20]!r} is not {BUNDLE_FORMAT}; "
                          "export it again with this musekern version")
    return index, metas


def import_bundle(cache: Cache, path: Path | str, trusted: TrustedKeys | None = None) -> ImportReport:
    """Verify every member of the bundle at `path`, then store the sound entries in `cache`.

    Raises BundleError (nothing imported) for an unreadable bundle, an unsafe member, or one too large in
    total; ReadOnlyCacheError / CacheAccessError when the cache cannot be written at all. A bad entry is
    listed in `report.rejected`, one that could not be written (disk full) in `report.failed`; the others are
    imported. With `trusted` keys (store/signing.py), an entry without a signature by one of them that verifies
    is rejected. Memory holds one entry at a time. Two passes over one open file: every header and the index
    (wherever it is: a GNU tar re-pack reorders members), then the entries' bytes.
    """
    path = Path(path)
    trusted = trusted or TrustedKeys()
    with _open(path) as f:
        names, index_raw = [], None
        for name, data in _walk(path, f, lambda name, size: name == INDEX_NAME):
            names.append(name)
            if name == INDEX_NAME:
                index_raw = data
        if index_raw is None:
            raise BundleError(f"{path}: no {INDEX_NAME}; not a musekern bundle (make one with `musekern export`)")
        index, metas = _index(path, index_raw)
        del index_raw
        report = _import_entries(cache, path, f, index, metas, names, trusted)
    if index.get("plan") and report.ok:
        hygiene.record_plan(cache, str(index["plan"]), [k for k in metas if is_key(k)])
        report.plan = str(index["plan"])
    return report


def _import_entries(cache: Cache, path: Path, f, index: dict, metas: dict, names: list,
                    trusted: TrustedKeys) -> ImportReport:
    report = ImportReport()
    keys_in_tar = {m.group(1) for m in map(_MEMBER_RE.match, names) if m}
    for k in sorted(metas):  # a key that is not one (a number, junk) is rejected, never a crash
        if not is_key(k):
            report.rejected.append((k, "not a cache key"))
    if any(is_key(k) for k in metas) or index.get("plan"):
        cache.require_writable(f"import {path.name}", "import")
    pending: dict[str, dict] = {}  # key -> the members read so far

    def finish(key: str) -> None:
        got = pending.pop(key)
        if key not in metas:
            report.rejected.append((key, "entry files not listed in the bundle index"))
            return
        try:
            parts, cubin, manifest = _check_entry(key, metas[key], got.get(MANIFEST_NAME), got.get(CUBIN_NAME))
            refusal = trusted.refusal(manifest)
            if refusal:
                raise ValueError(f"not trusted: {refusal}")
        except (ValueError, TypeError, KeyError) as e:
            report.rejected.append((key, str(e)[:600]))
            return
        if cache.sound(key) is not None:
            report.present.append(key)
            return
        try:
            cache.put(parts, cubin, manifest, command="import")
        except ValueError as e:  # anything else Cache.put refuses: this entry is rejected, the import goes on
            report.rejected.append((key, str(e)[:600]))
            return
        except ReadOnlyCacheError:
            raise
        except CacheError as e:  # disk full, I/O error: this entry is not stored, nothing torn
            report.failed.append((key, str(e)))
            return
        report.added.append(key)

    def wanted(name: str, size: int) -> bool:
        """An entry's files, only when the index lists them at that size (a lying header or a stray entry is
        rejected without its bytes in memory)."""
        if name == INDEX_NAME:
            return False
        key, file = _MEMBER_RE.match(name).groups()
        meta = metas.get(key)
        return isinstance(meta, dict) and (file == MANIFEST_NAME or meta.get("cubin_size") == size)

    for name, data in _walk(path, f, wanted):
        if name == INDEX_NAME:
            continue
        key, file = _MEMBER_RE.match(name).groups()
        pending.setdefault(key, {})[file] = data
        if len(pending[key]) == 2:
            finish(key)
    for key in sorted(pending):
        finish(key)
    for key in sorted(k for k in metas if is_key(k) and k not in keys_in_tar):
        report.rejected.append((key, "listed in the bundle index but its files are missing"))
    return report
