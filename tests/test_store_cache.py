"""store/cache.py: location, the commit protocol, integrity, read-only use, concurrency.

No GPU and no compiler: entries are made by a fake build (tests/store_fakes.py), so these tests run in
seconds on a 2-core CI machine.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import pytest
from store_fakes import chmod_w, fake_build, fake_cubin, fake_manifest, fake_parts, tree

from musekern.store import cache as cache_mod
from musekern.store import hygiene, lookup
from musekern.store.cache import (
    CACHE_FORMAT,
    ENV_CACHE_DIR,
    Cache,
    CacheAccessError,
    CorruptEntryError,
    MissingEntryError,
    ReadOnlyCacheError,
    default_cache_dir,
)
from musekern.store.keys import KeyParts
from musekern.store.lookup import Policy

EXACT = Policy(other_dsl=False, verify=False)
ANY_DSL = Policy(other_dsl=True, verify=False)


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "cache")


# ---------------------------------------------------------------- location
def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "env"))
    assert default_cache_dir(str(tmp_path / "cli")) == tmp_path / "cli"
    assert default_cache_dir(None) == tmp_path / "env"
    monkeypatch.delenv(ENV_CACHE_DIR)
    import platformdirs
    assert default_cache_dir(None) == Path(platformdirs.user_cache_dir("musekern"))


def test_cache_modules_import_no_compiler_or_gpu_stack():
    """The runtime (no cutlass there) imports cache/remote/bundle: they must not pull in cutlass/torch/cuda."""
    code = ("import sys, musekern.store.cache, musekern.store.remote, musekern.store.bundle\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'torch', 'cuda'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# ---------------------------------------------------------------- put / get / load
def test_put_get_load_roundtrip(cache):
    p = fake_parts()
    e = cache.put(p, fake_cubin(p), fake_manifest(p))
    assert e.key == p.key() and e.parts == p and e.kernel == "qk_norm" and e.arch == "sm_90a"
    assert e.label == p.label and e.size_bytes == len(fake_cubin(p)) + e.manifest_path.stat().st_size
    m = json.loads(e.manifest_path.read_bytes())
    for k in ("format", "key", "key_parts", "cubin_sha256", "cubin_size"):
        assert k in m
    assert m["format"] == CACHE_FORMAT and m["cubin_sha256"] == hashlib.sha256(fake_cubin(p)).hexdigest()
    assert not any("time" in k or "date" in k for k in m), "no timestamps in manifest.json"
    assert cache.get(p.key()) == e
    entry, data = cache.load(p.key())
    assert data == fake_cubin(p) and entry == e
    assert sorted(os.listdir(e.path)) == ["kernel.cubin", "manifest.json"]  # only JSON + cubin bytes
    assert cache.entries() == [e] and cache.verify_entry(e) == []
    assert cache.get("0" * 64) is None and lookup.find(cache, fake_parts(5), EXACT) is None
    with pytest.raises(MissingEntryError):
        cache.load("0" * 64)


def test_put_is_immutable_first_writer_wins(cache):
    p = fake_parts()
    first = cache.put(p, fake_cubin(p), fake_manifest(p))
    again = cache.put(p, b"\x7fELF different", fake_manifest(p))
    assert again == first and cache.load(p.key())[1] == fake_cubin(p)


def test_put_rejects_manifest_that_disagrees_with_key(cache):
    p = fake_parts()
    with pytest.raises(ValueError):
        cache.put(p, fake_cubin(p), {**fake_manifest(p), "arch": "sm_100a"})
    with pytest.raises(ValueError):
        cache.put(p, fake_cubin(p), {**fake_manifest(p), "cubin_sha256": "0" * 64})
    assert cache.entries() == []


def test_put_replaces_a_damaged_entry(cache):
    p = fake_parts()
    e = cache.put(p, fake_cubin(p), fake_manifest(p))
    chmod_w(e.cubin_path)
    e.cubin_path.write_bytes(b"junk")
    cache.put(p, fake_cubin(p), fake_manifest(p))
    assert cache.load(p.key())[1] == fake_cubin(p)


def test_entries_ignore_temp_locks_and_uncommitted_dirs(cache):
    p = fake_parts()
    cache.obtain(p, fake_build(p))
    (cache.tmp_dir / "junk").mkdir(parents=True)
    (cache.entries_dir / ("f" * 64)).mkdir()  # no manifest: never committed
    (cache.entries_dir / "not-a-key").mkdir()
    assert [e.key for e in cache.entries()] == [p.key()]
    assert cache.entry_keys() == sorted([p.key(), "f" * 64])
    assert cache.get("f" * 64) is None


# ---------------------------------------------------------------- integrity
def _damage(e, how: str, cache: Cache):
    chmod_w(e.cubin_path)
    chmod_w(e.manifest_path)
    if how == "truncated":
        e.cubin_path.write_bytes(e.cubin_path.read_bytes()[:10])
    elif how == "corrupted":
        b = bytearray(e.cubin_path.read_bytes())
        b[-1] ^= 0xFF
        e.cubin_path.write_bytes(bytes(b))
    elif how == "cubin_missing":
        e.cubin_path.unlink()
    elif how == "manifest_garbage":
        e.manifest_path.write_bytes(b"{not json")
    elif how == "foreign":
        # a valid entry of another key copied under this key's directory
        q = fake_parts(99)
        other = cache.put(q, fake_cubin(q), fake_manifest(q))
        shutil.rmtree(e.path)
        shutil.copytree(other.path, e.path)
    elif how == "forged_parts":
        # the manifest claims this key but its parts hash elsewhere (hand-edited)
        m = json.loads(e.manifest_path.read_bytes())
        m["key_parts"]["arch"] = "sm_100a"
        m["arch"] = "sm_100a"
        e.manifest_path.write_text(json.dumps(m))


@pytest.mark.parametrize("how", ["truncated", "corrupted", "cubin_missing", "manifest_garbage", "foreign",
                                 "forged_parts"])
def test_damaged_entry_is_never_loaded_and_is_rebuilt(cache, tmp_path, how):
    p = fake_parts()
    e = cache.put(p, fake_cubin(p), fake_manifest(p))
    _damage(e, how, cache)
    with pytest.raises(CorruptEntryError) as ei:
        cache.load(p.key())
    msg = str(ei.value)
    assert p.key()[:16] in msg and "musekern verify --repair" in msg and "musekern prepare" in msg
    assert ei.value.problems and cache.verify_entry(p.key()) == ei.value.problems
    assert p.key() in cache.audit()
    # prepare's path: a damaged entry is a miss and gets rebuilt once
    counter = tmp_path / "builds.log"
    entry, source = cache.obtain(p, fake_build(p, counter))
    assert source == "built" and counter.read_text().count(p.key()) == 1
    assert cache.load(p.key())[1] == fake_cubin(p) and p.key() not in cache.audit()


def test_remove_and_touch(cache):
    p = fake_parts()
    e = cache.put(p, fake_cubin(p), fake_manifest(p))
    committed = cache.last_used(e)
    cache.touch(p.key())
    assert (cache.used_dir / p.key()).exists() and cache.last_used(e) >= committed
    cache.remove(p.key())
    assert cache.get(p.key()) is None and not (cache.used_dir / p.key()).exists()
    cache.remove(p.key())  # idempotent


# ---------------------------------------------------------------- read-only deploys
def _populated(tmp_path, n=3) -> tuple[Cache, list[KeyParts]]:
    c = Cache(tmp_path / "ro")
    parts = [fake_parts(i) for i in range(n)]
    for p in parts:
        c.obtain(p, fake_build(p))
    shutil.rmtree(c.locks_dir)  # a shipped cache dir (image layer) has no lock files
    return c, parts


def _assert_reads_write_nothing(c: Cache, parts):
    before = tree(c.root)
    assert c.read_only
    for p in parts:
        e, data = c.load(p.key())
        assert data == fake_cubin(p)
        assert lookup.find(c, p, EXACT) == e and lookup.find(c, p, ANY_DSL) == e
        c.touch(p.key())  # the loader records use; must be a no-op here
        assert c.obtain(p, fake_build(p)) == (e, "local")  # hit without taking a lock
    assert len(c.entries()) == len(parts) and c.audit() == {}
    lookup.nearest(c, fake_parts(50))
    hygiene.stats(c)
    with pytest.raises(ReadOnlyCacheError) as ei:
        c.obtain(fake_parts(50), fake_build(fake_parts(50)))
    assert "\n" not in str(ei.value) and "read-only" in str(ei.value) and "--cache-dir" in str(ei.value)
    with pytest.raises(ReadOnlyCacheError):
        c.put(fake_parts(51), b"x", fake_manifest(fake_parts(51)))
    with pytest.raises(ReadOnlyCacheError):
        hygiene.record_plan(c, "p", [])
    assert tree(c.root) == before, "a read-only cache was written"


def test_read_only_by_access_check_writes_nothing(tmp_path):
    """As root chmod does not stop writes, so emulate an unwritable dir through os.access."""
    c, parts = _populated(tmp_path)
    real_access = os.access

    def access(path, mode, *a, **k):
        if mode & os.W_OK and str(path).startswith(str(c.root)):
            return False
        return real_access(path, mode, *a, **k)

    with mock.patch.object(cache_mod.os, "access", access):
        _assert_reads_write_nothing(c, parts)


def test_read_only_by_chmod_writes_nothing(tmp_path):
    """Also as root, whom mode bits do not stop: the store holds itself to them (DESIGN.md's one miss was a root
    user writing a last-used stamp into a cache made read-only by chmod)."""
    c, parts = _populated(tmp_path)
    for dirpath, dirnames, filenames in os.walk(c.root):
        for n in filenames + dirnames:
            os.chmod(Path(dirpath, n), 0o555 if Path(dirpath, n).is_dir() else 0o444)
    os.chmod(c.root, 0o555)
    try:
        _assert_reads_write_nothing(c, parts)
    finally:
        for dirpath, _dirnames, _ in os.walk(c.root):
            os.chmod(dirpath, 0o755)


@contextlib.contextmanager
def ro_bind_mount(src: Path, dst: Path):
    dst.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"bind mount not permitted here: {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(dst)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"read-only remount not permitted here: {r.stderr.strip()}")
        yield dst
    finally:
        subprocess.run(["umount", str(dst)], capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root and mount(8)")
def test_read_only_mount_writes_nothing(tmp_path):
    """The real deploy case: the cache dir is a read-only layer (here a ro bind mount)."""
    c, parts = _populated(tmp_path)
    with ro_bind_mount(c.root, tmp_path / "mnt") as mnt:
        ro = Cache(mnt)
        with pytest.raises(OSError):
            (mnt / "probe").write_bytes(b"x")
        _assert_reads_write_nothing(ro, parts)
        assert Cache(mnt / "missing" / "sub").read_only  # missing root that cannot be created


def test_a_root_below_a_file_is_not_a_directory(tmp_path):
    """MUSEKERN_CACHE_DIR pointing at (or below) a file: reads see an empty cache, a write says "not a directory"
    naming the file (before: "read-only", which sends the user to the wrong fix)."""
    f = tmp_path / "file"
    f.write_text("x")
    for c in (Cache(f / "cache"), Cache(f)):
        assert c.read_only and c.entries() == [] and c.get(fake_parts().key()) is None
        with pytest.raises(CacheAccessError, match="is not a directory") as ei:
            c.put(fake_parts(), b"x", fake_manifest(fake_parts()))
        assert not isinstance(ei.value, ReadOnlyCacheError) and str(f) in str(ei.value)
        with pytest.raises(CacheAccessError, match="is not a directory"):
            c.check_root()
    assert not Cache(tmp_path / "new" / "cache").read_only  # creatable: writable, nothing created yet
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- concurrency
PROCS, ROUNDS, KEYS_PER_ROUND = 16, 50, 4


def _stress_worker(root: str, counter: str, wid: int, errors: str) -> None:
    rng = random.Random(wid)
    c = Cache(root)
    bad = []
    for r in range(ROUNDS):
        idx = list(range(r * KEYS_PER_ROUND, (r + 1) * KEYS_PER_ROUND))
        rng.shuffle(idx)  # different processes race on different keys first
        for i in idx:
            p = fake_parts(i)
            try:
                try:  # a reader racing the writer sees no entry or a whole one, never a torn one
                    c.load(p.key())
                except MissingEntryError:
                    pass
                e, _ = c.obtain(p, fake_build(p, Path(counter)))
                e2, data = c.load(p.key())
                if data != fake_cubin(p) or e2.key != p.key():
                    bad.append(f"round {r} key {i}: wrong bytes")
                problems = c.verify_entry(e2)
                if problems:
                    bad.append(f"round {r} key {i}: {problems}")
            except Exception:
                bad.append(f"round {r} key {i}: {traceback.format_exc()}")
    Path(errors).write_text("\n".join(bad))
    os._exit(1 if bad else 0)


def test_stress_many_processes_build_each_key_once(tmp_path):
    """Issue 4.1: 16 processes x 50 rounds of prepare + load + verify on one cache: zero
    failures, zero torn or duplicate entries, every key built exactly once."""
    root, counter = tmp_path / "shared", tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    t0 = time.monotonic()
    procs = [ctx.Process(target=_stress_worker, args=(str(root), str(counter), w, str(tmp_path / f"err{w}")))
             for w in range(PROCS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    errors = {w: (tmp_path / f"err{w}").read_text() for w in range(PROCS) if (tmp_path / f"err{w}").exists()}
    assert all(p.exitcode == 0 for p in procs), {w: e[:2000] for w, e in errors.items() if e}
    built = counter.read_text().split()
    n_keys = ROUNDS * KEYS_PER_ROUND
    assert len(built) == n_keys and len(set(built)) == n_keys, "a key was built more than once"
    c = Cache(root)
    assert len(c.entries()) == n_keys and len(c.entry_keys()) == n_keys
    assert c.audit() == {}
    assert not [p for p in c.tmp_dir.iterdir()], "staging dirs left behind"
    print(f"stress: {PROCS}x{ROUNDS} rounds in {time.monotonic() - t0:.1f}s")
