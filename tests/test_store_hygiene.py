"""store/hygiene.py: gc by last use and size, recorded plans (clean --stale), stats, staging debris, clear."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from store_fakes import fake_cubin, fake_manifest, fake_parts

from musekern.store import hygiene
from musekern.store.cache import Cache, CacheError


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "cache")


def test_gc_older_than_and_max_size(cache):
    parts = [fake_parts(i) for i in range(4)]
    for p in parts:
        cache.put(p, fake_cubin(p), fake_manifest(p))
    now = time.time()
    for age_days, p in zip((40, 20, 5, 1), parts, strict=True):
        cache.touch(p.key())
        t = now - age_days * 86400
        os.utime(cache.used_dir / p.key(), (t, t))
    removed = hygiene.gc(cache, older_than=30 * 86400, now=now)
    assert [e.key for e in removed] == [parts[0].key()]
    two_newest = sum(cache.get(p.key()).size_bytes for p in parts[2:])
    dry = hygiene.gc(cache, max_size=two_newest, now=now, dry_run=True)
    assert [e.key for e in dry] == [parts[1].key()] and len(cache.entries()) == 3  # dry run removes nothing
    removed = hygiene.gc(cache, max_size=two_newest, now=now)
    assert [e.key for e in removed] == [parts[1].key()]  # least recently used first
    assert {e.key for e in cache.entries()} == {parts[2].key(), parts[3].key()}
    with pytest.raises(ValueError):
        hygiene.gc(cache)


def test_record_plan_and_stale_entries(cache):
    parts = [fake_parts(i) for i in range(3)]
    for p in parts:
        cache.put(p, fake_cubin(p), fake_manifest(p))
    with pytest.raises(CacheError, match="no plan is recorded"):
        hygiene.stale_entries(cache)
    hygiene.record_plan(cache, "/path/to/cfg.json|h200", [parts[0].key()])  # any name (a path) is fine
    hygiene.record_plan(cache, "other", [parts[1].key()])
    assert hygiene.plans(cache) == {"/path/to/cfg.json|h200": [parts[0].key()], "other": [parts[1].key()]}
    assert [e.key for e in hygiene.stale_entries(cache)] == [parts[2].key()]
    hygiene.forget_plan(cache, "other")
    assert {e.key for e in hygiene.stale_entries(cache)} == {parts[1].key(), parts[2].key()}
    with pytest.raises(ValueError):
        hygiene.record_plan(cache, "x", ["not-a-key"])


def test_stats_and_clean(cache):
    a, b = fake_parts(0), fake_parts(1, kernel="qkv_front", arch="sm_100a")
    for p in (a, b):
        cache.put(p, fake_cubin(p), fake_manifest(p))
    s = hygiene.stats(cache)
    assert s["entries"] == 2 and s["bytes"] == sum(e.size_bytes for e in cache.entries())
    assert s["by_kernel"]["qk_norm"]["entries"] == 1 and s["by_arch"]["sm_100a"]["entries"] == 1
    # staging debris is told apart from a live writer's staging dir by the key's lock, not by its age
    dead = cache.tmp_dir / f"{a.key()}.123.dead"
    dead.mkdir(parents=True)
    (dead / "kernel.cubin").write_bytes(b"x" * 100)
    live = cache.tmp_dir / f"{b.key()}.456.live"
    live.mkdir()
    stray = cache.tmp_dir / "stray"
    stray.write_bytes(b"y")
    with cache.lock(b.key()):  # held by this thread: is_locked sees it like another process's
        s = hygiene.stats(cache)
        assert s["staging"] == {"live": 1, "debris": 2, "debris_bytes": 101}
        assert hygiene.clean_tmp(cache, dry_run=True) == 2 and dead.exists()
        assert hygiene.clean_tmp(cache) == 2 and live.exists() and not dead.exists() and not stray.exists()
    assert hygiene.clean_tmp(cache) == 1 and not live.exists()  # its writer let go: debris now
    assert hygiene.clear(cache) == {"removed": sorted([a.key(), b.key()]), "busy": []} and cache.entries() == []


# ---------------------------------------------------------------- maintenance beside writers


def _writer_stopped_mid_staging(root: str, i: int, ready, go, result, die: bool) -> None:
    """Child: put entry `i`, stopping after its staging dir is written (before the rename that commits it):
    wait there for `go`, or (die=True) SIGKILL itself there, leaving the staging dir as a crash would."""
    import signal

    from musekern.store import cache as cache_mod

    real = cache_mod.fsync_dir

    def stop_in_staging(path):
        if "tmp" in Path(path).parts:
            ready.set()
            if die:
                os.kill(os.getpid(), signal.SIGKILL)
            go.wait(30)
        real(path)

    cache_mod.fsync_dir = stop_in_staging
    try:
        c = Cache(root)
        p = fake_parts(i)
        c.put(p, fake_cubin(p), fake_manifest(p))
        result.put(("ok", c.verify_entry(p.key())))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.put(("error", f"{type(e).__name__}: {e}"))


def _mp():
    import multiprocessing

    return multiprocessing.get_context("fork")


def test_clean_all_beside_a_live_writer_never_tears_its_entry(cache):
    """clean --all (hygiene.clear) while a writer stages: the writer's staging dir is left alone and its
    entry commits whole (before: clear deleted tmp/ under it; the review saw torn entries returned as built)."""
    for i in range(3):
        p = fake_parts(i)
        cache.put(p, fake_cubin(p), fake_manifest(p))
    ctx = _mp()
    ready, go, result = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_writer_stopped_mid_staging, args=(str(cache.root), 7, ready, go, result, False))
    child.start()
    try:
        assert ready.wait(30)
        hygiene.clear(cache)
        hygiene.clean_tmp(cache)
    finally:
        go.set()
        child.join(30)
    status, detail = result.get(timeout=5)
    assert status == "ok" and detail == [], detail
    assert [e.key for e in cache.entries()] == [fake_parts(7).key()]


def test_a_killed_writers_staging_dir_is_removed_by_clean_at_once(cache):
    """kill -9 of a writer mid-staging leaves debris; clean removes it right away (before: kept for an hour)."""
    ctx = _mp()
    ready, go, result = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_writer_stopped_mid_staging, args=(str(cache.root), 1, ready, go, result, True))
    child.start()
    child.join(30)
    assert child.exitcode == -9 and list(cache.tmp_dir.iterdir())
    assert hygiene.clean_tmp(cache) == 1
    assert list(cache.tmp_dir.iterdir()) == []
