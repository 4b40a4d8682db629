"""musekern.bundle: reproducible, relocatable, verified bundles; sharded warming merges by import."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest
from store_fakes import abi_json, fail_writes_under, fake_symbol

from musekern.store import hygiene
from musekern.store.bundle import INDEX_NAME, BundleError, export_bundle, import_bundle
from musekern.store.cache import Cache, CacheError, CorruptEntryError, MissingEntryError, ReadOnlyCacheError
from musekern.store.keys import KeyParts

SRC = "ab" * 32


def fake_parts(i: int, arch: str = "sm_90a") -> KeyParts:
    return KeyParts.make("qk_norm", {"dtype": "bfloat16", "head_dim": 64, "has_scale": bool(i % 2), "i": i},
                         arch, SRC, "4.8.1", 1)


def fake_entry(parts: KeyParts) -> tuple[bytes, dict]:
    cubin = b"\x7fELF" + hashlib.sha256(parts.key().encode()).digest() * 4
    return cubin, {"kernel": parts.kernel, "label": parts.label, "variant": parts.variant_params,
                   "symbol": fake_symbol(parts.kernel, parts.variant_params, "k"),
                   "arch": parts.arch, "abi": abi_json(parts.kernel, parts.variant_params),
                   "built_with": {"nvidia-cutlass-dsl": parts.dsl_version}}


def put(cache: Cache, parts: KeyParts):
    return cache.put(parts, *fake_entry(parts))


def filled(path: Path, idx, order=None) -> Cache:
    c = Cache(path)
    for i in (order or idx):
        put(c, fake_parts(i))
    return c


# ---------------------------------------------------------------- reproducible and relocatable
@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_export_is_byte_reproducible_across_machines(tmp_path, suffix):
    """Two 'machines': different cache paths, insertion order, umask and file times: same bytes."""
    a = filled(tmp_path / "machine-a" / "cache", range(5))
    old = os.umask(0o077)
    try:
        b = filled(tmp_path / "elsewhere" / "b", range(5), order=[4, 2, 0, 3, 1])
    finally:
        os.umask(old)
    for e in b.entries():
        os.utime(e.cubin_path, (time.time() - 86400 * 3,) * 2)
    keys = [fake_parts(i).key() for i in range(5)]
    out1, out2, out3 = (tmp_path / f"b{n}{suffix}" for n in range(3))
    export_bundle(a, keys, out1)
    time.sleep(1.1)  # a second later: mtimes must not leak in
    export_bundle(b, list(reversed(keys)), out2)
    export_bundle(a, keys, out3)
    assert out1.read_bytes() == out2.read_bytes() == out3.read_bytes()


def test_bundle_members_are_relative_sorted_and_fixed(tmp_path):
    c = filled(tmp_path / "cache", range(3))
    keys = sorted(fake_parts(i).key() for i in range(3))
    out = tmp_path / "x.tar"
    export_bundle(c, keys, out, plan_name="cfg|h200")
    with tarfile.open(out) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names[0] == INDEX_NAME
        assert names[1:] == [f"entries/{k}/{f}" for k in keys for f in ("manifest.json", "kernel.cubin")]
        for m in members:
            assert m.isreg() and not m.name.startswith("/") and ".." not in m.name
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
        blob = b"".join(tar.extractfile(m).read() for m in members)
    assert str(tmp_path).encode() not in blob and str(c.root).encode() not in blob  # no absolute paths
    index = json.loads(tarfile.open(out).extractfile(INDEX_NAME).read())
    assert index["plan"] == "cfg|h200" and [e["key"] for e in index["entries"]] == keys


def test_export_refuses_damaged_or_missing_entries(tmp_path):
    c = filled(tmp_path / "cache", range(2))
    e = c.get(fake_parts(0).key())
    os.chmod(e.cubin_path, 0o644)
    e.cubin_path.write_bytes(b"\x7fELF truncated")
    with pytest.raises(CorruptEntryError):
        export_bundle(c, [e.key], tmp_path / "x.tar")
    with pytest.raises(MissingEntryError):
        export_bundle(c, ["0" * 64], tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists() and not list(tmp_path.glob(".x.tar*"))  # no half bundle


# ---------------------------------------------------------------- import
def test_import_roundtrip_and_plan(tmp_path):
    src = filled(tmp_path / "src", range(4))
    keys = [fake_parts(i).key() for i in range(4)]
    out = tmp_path / "b.tar"
    export_bundle(src, keys, out, plan_name="cfg|h200")
    dst = Cache(tmp_path / "dst")
    put(dst, fake_parts(0))
    report = import_bundle(dst, out)
    assert report.ok and sorted(report.added) == sorted(keys[1:]) and report.present == [keys[0]]
    assert report.plan == "cfg|h200" and hygiene.plans(dst) == {"cfg|h200": sorted(keys)}
    for k in keys:
        assert dst.load(k)[1] == src.load(k)[1]
        assert dst.get(k).manifest_path.read_bytes() == src.get(k).manifest_path.read_bytes()
    assert import_bundle(dst, out).added == []  # idempotent


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy a bundle member by member, letting `edit(name, data)` change or drop members."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.USTAR_FORMAT) as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            res = edit(m.name, data)
            if res is None:
                continue
            name, data = res
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tout.addfile(ti, io.BytesIO(data))


def test_import_rejects_corrupted_and_foreign_entries(tmp_path):
    src = filled(tmp_path / "src", range(3))
    k = [fake_parts(i).key() for i in range(3)]
    good = tmp_path / "good.tar"
    export_bundle(src, k, good, plan_name="p")

    def edit(name, data):
        if name == f"entries/{k[0]}/kernel.cubin":
            return name, data[:-1] + bytes([data[-1] ^ 1])  # flipped bit
        if name == f"entries/{k[1]}/kernel.cubin":
            return name, data[:8]  # truncated
        return name, data

    bad = tmp_path / "bad.tar"
    _rewrite(good, bad, edit)
    dst = Cache(tmp_path / "dst")
    report = import_bundle(dst, bad)
    assert not report.ok and {key for key, _ in report.rejected} == {k[0], k[1]}
    assert report.added == [k[2]] and [e.key for e in dst.entries()] == [k[2]]
    assert report.plan is None  # a partly bad bundle does not record its plan

    # a manifest and index consistently swapped to another key (a forged bundle) is caught by the key check
    def forge(name, data):
        if name == INDEX_NAME:
            idx = json.loads(data)
            idx["entries"][0]["key"] = "e" * 64
            return name, json.dumps(idx).encode()
        return name.replace(k[0], "e" * 64), data

    forged = tmp_path / "forged.tar"
    _rewrite(good, forged, forge)
    report = import_bundle(Cache(tmp_path / "dst2"), forged)
    assert ("e" * 64) in {key for key, _ in report.rejected}
    assert Cache(tmp_path / "dst2").get("e" * 64) is None


def test_import_rejects_a_manifest_disagreeing_with_its_key_and_goes_on(tmp_path):
    """A manifest whose kernel field contradicts its key parts (index hashes fixed up) is one rejected
    entry, not a crash halfway through the import; and a non-string key in the index is rejected too."""
    src = filled(tmp_path / "src", range(2))
    k = [fake_parts(i).key() for i in range(2)]
    good = tmp_path / "good.tar"
    export_bundle(src, k, good)
    new_manifest = {}

    def tamper(name, data):
        if name == f"entries/{k[0]}/manifest.json":
            m = json.loads(data)
            m["kernel"] = "evil"
            new_manifest["bytes"] = json.dumps(m, sort_keys=True, indent=1).encode()
            return name, new_manifest["bytes"]
        return name, data

    stage = tmp_path / "stage.tar"
    _rewrite(good, stage, tamper)

    def fix_index(name, data):
        if name == INDEX_NAME:
            idx = json.loads(data)
            for e in idx["entries"]:
                if e["key"] == k[0]:
                    e["manifest_sha256"] = hashlib.sha256(new_manifest["bytes"]).hexdigest()
            idx["entries"].append({"key": 5})
            return name, json.dumps(idx).encode()
        return name, data

    bad = tmp_path / "bad.tar"
    _rewrite(stage, bad, fix_index)
    dst = Cache(tmp_path / "dst")
    report = import_bundle(dst, bad)
    rejected = dict(report.rejected)
    assert "kernel" in rejected[k[0]] and "5" in rejected and report.added == [k[1]]


@pytest.mark.parametrize("evil", ["../evil", "/etc/evil", "entries/../../evil", "entries/x/kernel.cubin",
                                  "link", "entries/" + "a" * 64 + "/other.bin"])
def test_import_rejects_path_traversal_and_odd_members(tmp_path, evil):
    src = filled(tmp_path / "src", range(1))
    good = tmp_path / "good.tar"
    export_bundle(src, [fake_parts(0).key()], good)
    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as tin, tarfile.open(bad, "w", format=tarfile.GNU_FORMAT) as tout:
        for m in tin.getmembers():
            tout.addfile(m, tin.extractfile(m))
        ti = tarfile.TarInfo(evil)
        if evil == "link":
            ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tout.addfile(ti)
        else:
            ti.size = 4
            tout.addfile(ti, io.BytesIO(b"evil"))
    dst = Cache(tmp_path / "dst")
    with pytest.raises(BundleError, match="nothing was imported"):
        import_bundle(dst, bad)
    assert not dst.root.exists()
    assert not (tmp_path / "evil").exists()


def test_import_rejects_symlink_disguised_as_entry(tmp_path):
    ti = tarfile.TarInfo(f"entries/{'a' * 64}/kernel.cubin")
    ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tout:
        tout.addfile(ti)
    with pytest.raises(BundleError, match="not a regular file"):
        import_bundle(Cache(tmp_path / "dst"), bad)


def test_import_garbage_and_truncated_files(tmp_path):
    g = tmp_path / "garbage.tar"
    g.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(BundleError):
        import_bundle(Cache(tmp_path / "d"), g)
    src = filled(tmp_path / "src", range(3))
    full = tmp_path / "full.tar.gz"
    export_bundle(src, [fake_parts(i).key() for i in range(3)], full)
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(full.read_bytes()[: len(full.read_bytes()) // 2])
    with pytest.raises(BundleError):
        import_bundle(Cache(tmp_path / "d"), cut)
    gzip.decompress(full.read_bytes())  # the full one is a valid gzip


def test_import_into_read_only_cache_fails_clearly(tmp_path):
    src = filled(tmp_path / "src", range(1))
    out = tmp_path / "b.tar"
    export_bundle(src, [fake_parts(0).key()], out)
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)  # no write bit: read-only for root too (the store holds itself to mode bits)
    with pytest.raises(ReadOnlyCacheError, match="musekern import"):
        import_bundle(Cache(ro / "cache"), out)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(CacheError, match="not a directory"):
        import_bundle(Cache(f / "cache"), out)


# ---------------------------------------------------------------- sharded CI warming (issue 4.7)
def _plan():
    from musekern.config import load_config
    from musekern.plan import plan_model
    from musekern.targets import get_target

    return plan_model(load_config(None), [get_target("h200"), get_target("b200")])


def _parts(pe) -> KeyParts:
    from musekern.store.keys import key_parts

    return key_parts(pe, pe.arch, "4.8.1")


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_are_disjoint_and_cover_the_plan(n):
    from musekern.plan import PlanEntry, shard_plan

    plan = _plan()
    shards = [shard_plan(plan, k, n) for k in range(1, n + 1)]
    seen = [(e.target.name, e.variant) for s in shards for e in s]
    assert len(seen) == len(set(seen)) == len(plan)  # disjoint, and their union is the whole plan
    assert set(seen) == {(e.target.name, e.variant) for e in plan}
    assert shards == [shard_plan(list(reversed(plan)), k, n) for k in range(1, n + 1)]  # deterministic
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        shard_plan(plan, 0, n)
    assert isinstance(plan[0], PlanEntry)


def test_shards_merge_by_import(tmp_path):
    """Two CI jobs each warm one shard and export it; importing both into a third cache gives the union."""
    from musekern.plan import shard_plan

    plan = _plan()
    bundles = []
    for k in (1, 2):
        c = Cache(tmp_path / f"job{k}")
        keys = []
        for pe in shard_plan(plan, k, 2):
            p = _parts(pe)
            c.obtain(p, lambda p=p: fake_entry(p))
            keys.append(p.key())
        out = tmp_path / f"shard{k}.tar"
        export_bundle(c, keys, out)
        bundles.append(out)
    merged = Cache(tmp_path / "merged")
    for b in bundles:
        assert import_bundle(merged, b).ok
    assert {e.key for e in merged.entries()} == {_parts(pe).key() for pe in plan}
    assert merged.audit() == {}


# ---------------------------------------------------------------- issue 12: hostile bundles, disk full


def _zeros_bundle(path: Path, members: int, size: int) -> None:
    """A .tar.xz whose index is fine and whose entries are `members` cubins of `size` zero bytes each
    (compresses to almost nothing: the decompression bomb of the review, scaled by `size`)."""
    keys = [f"{i:064x}" for i in range(members)]
    index = {"bundle_format": 1, "cache_format": 2, "entries": [
        {"key": k, "manifest_sha256": "0" * 64, "cubin_sha256": "0" * 64, "cubin_size": size} for k in keys]}
    ibytes = json.dumps(index).encode()

    class Zeros(io.RawIOBase):
        def __init__(self, n):
            self.left = n

        def readable(self):
            return True

        def readinto(self, b):
            n = min(len(b), self.left)
            b[:n] = bytes(n)
            self.left -= n
            return n

    with tarfile.open(path, "w:xz", preset=0) as tar:
        ti = tarfile.TarInfo(INDEX_NAME)
        ti.size = len(ibytes)
        tar.addfile(ti, io.BytesIO(ibytes))
        for k in keys:
            ti = tarfile.TarInfo(f"entries/{k}/kernel.cubin")
            ti.size = size
            tar.addfile(ti, io.BufferedReader(Zeros(size)))


def test_a_decompression_bomb_is_rejected_early_in_bounded_memory(tmp_path, monkeypatch):
    """Members each under the per-member cap whose total is far above the bundle cap: rejected from the tar
    headers, before their data is held (the review's 0.3 MB .tar.xz of 8 x 256 MiB reached 2.1 GB RSS; here
    the same shape at 8 x 4 MiB against a cap lowered to 8 MiB)."""
    import tracemalloc

    from musekern.store import bundle as bundle_mod

    monkeypatch.setattr(bundle_mod, "MAX_BUNDLE_BYTES", 8 << 20, raising=False)
    bomb = tmp_path / "bomb.tar.xz"
    _zeros_bundle(bomb, 8, 4 << 20)
    assert bomb.stat().st_size < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(BundleError, match="total"):
            import_bundle(Cache(tmp_path / "dst"), bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"held {peak >> 20} MiB"


@pytest.mark.parametrize("where,payload", [("index", "nested"), ("manifest", "nested"),
                                           ("index", "1e999"),  # (bundle_format 1e999 was refused before too)
                                           ("manifest", "1e999")])
def test_nested_json_and_huge_numbers_in_a_bundle_are_rejected_not_a_traceback(tmp_path, where, payload):
    src = filled(tmp_path / "src", range(2))
    k = [fake_parts(i).key() for i in range(2)]
    good = tmp_path / "good.tar"
    export_bundle(src, k, good)
    target = INDEX_NAME if where == "index" else f"entries/{k[0]}/manifest.json"
    fixed = {}

    def poison(name, data):
        if name != target:
            return name, data
        if payload == "nested":
            data = b"[" * 100_000 + b"]" * 100_000
        else:
            data = data.replace(b'"abi_version": 1', b'"abi_version": 1e999').replace(
                b'"bundle_format": 1', b'"bundle_format": 1e999')
        fixed["sha"] = hashlib.sha256(data).hexdigest()
        return name, data

    stage = tmp_path / "stage.tar"
    _rewrite(good, stage, poison)
    bad = tmp_path / "bad.tar"

    def fix_index(name, data):  # a consistent forgery: the index vouches for the poisoned manifest
        if name == INDEX_NAME and where == "manifest":
            idx = json.loads(data)
            idx["entries"][0]["manifest_sha256"] = fixed["sha"]
            data = json.dumps(idx).encode()
        return name, data

    _rewrite(stage, bad, fix_index)
    dst = Cache(tmp_path / "dst")
    if where == "index":
        with pytest.raises(BundleError):
            import_bundle(dst, bad)
    else:
        report = import_bundle(dst, bad)
        assert k[0] in dict(report.rejected) and report.added == [k[1]]


def test_import_onto_a_full_disk_fails_per_entry_and_tears_nothing(tmp_path, monkeypatch):
    src = filled(tmp_path / "src", range(3))
    out = tmp_path / "b.tar"
    export_bundle(src, [fake_parts(i).key() for i in range(3)], out)
    dst = Cache(tmp_path / "dst")
    one = src.get(fake_parts(0).key())
    fail_writes_under(monkeypatch, dst.root, after_bytes=one.size_bytes * 3 // 2)  # room for one entry
    report = import_bundle(dst, out)
    assert not report.ok and report.added[:1] and len(report.added) < 3
    monkeypatch.undo()
    assert dst.audit() == {} and not list(dst.tmp_dir.iterdir())
