"""store/record_folders.py: a folder of records another part keeps in the cache reaches the store's maintenance
(clean, clean --all, stats, the own-directory check) through the hook alone; `import musekern` registers the GEMM
tuning records' folder without importing them."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from musekern.cli import main
from musekern.store import hygiene, locks, record_folders
from musekern.store.cache import Cache
from musekern.store.owndirs import NotOwnDirError
from musekern.store.record_folders import RecordFolder


def _folder(name: str = "probe_records", calls: list | None = None) -> RecordFolder:
    """A real (small) record folder: <base>/probe/*.rec, temp files .*.tmp, writers under locks/probe.lock."""
    path = lambda c: c.base / "probe"  # noqa: E731
    lock = lambda c: c.locks_dir / "probe.lock"  # noqa: E731

    def names(c, debris=False):
        try:
            return sorted(n for n in os.listdir(path(c)) if n.endswith(".tmp" if debris else ".rec"))
        except OSError:
            return []

    def clean_debris(c, dry_run):
        (calls if calls is not None else []).append(("clean_debris", dry_run))
        gone = names(c, debris=True)
        for n in gone if not dry_run else ():
            os.unlink(path(c) / n)
        return len(gone)

    def clear(c):
        (calls if calls is not None else []).append(("clear",))
        gone = names(c)
        for n in gone:
            os.unlink(path(c) / n)
        return gone

    return RecordFolder(name=name, what="probe record", path=path, lock=lock, files=names,
                        summary=lambda c: {"files": len(names(c))}, clean_debris=clean_debris, clear=clear)


@contextlib.contextmanager
def registered(*folders):
    factories = [lambda f=f: f for f in folders]
    for f in factories:
        record_folders.register(f)
    try:
        yield
    finally:
        for f in factories:
            record_folders.unregister(f)


@pytest.fixture
def cache(tmp_path) -> Cache:
    c = Cache(tmp_path / "cache")
    c._mkdirs(c.locks_dir)
    (c.base / "probe").mkdir()
    for n in ("a.rec", "b.rec", ".a.rec.1.dead.tmp"):
        (c.base / "probe" / n).write_text("{}")
    return c


def test_a_registered_folder_is_cleaned_counted_and_cleared(cache):
    calls = []
    with registered(_folder(calls=calls)):
        s = hygiene.stats(cache)
        assert s["probe_records"] == {"files": 2} and s["gemm_tuning"] == {}  # beside the GEMM records' own
        assert hygiene.clean_tmp(cache, dry_run=True) == 1 and calls == [("clean_debris", True)]
        assert hygiene.clean_tmp(cache) == 1 and not (cache.base / "probe" / ".a.rec.1.dead.tmp").exists()
        out = hygiene.clear(cache)
        assert out["records"] == {"gemm_tuning": [], "probe_records": ["a.rec", "b.rec"]} and out["skipped"] == []
        assert os.listdir(cache.base / "probe") == []
    assert "probe_records" not in hygiene.stats(cache)  # unregistered: the store knows it no more


def test_a_held_writer_lock_keeps_the_records_and_says_so_once(cache):
    calls = []
    with registered(_folder(calls=calls)), locks.held(cache.locks_dir / "probe.lock", wait=False,
                                                        on_error=lambda e, p: e) as held:
        assert held
        assert hygiene.clean_tmp(cache) == 0  # its temp file may be a live writer's
        out = hygiene.clear(cache)
        assert out["records"]["probe_records"] == [] and sorted(os.listdir(cache.base / "probe"))[1:] == [
            "a.rec", "b.rec"]
        assert len(out["skipped"]) == 1 and "probe records kept" in out["skipped"][0]
        assert str(cache.locks_dir / "probe.lock") in out["skipped"][0] and "clean --all" in out["skipped"][0]
    assert calls == []  # never asked to clean while its writer was at work


def test_a_link_in_its_place_makes_maintenance_refuse_the_cache(cache, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.rec").write_text("{}")
    for n in os.listdir(cache.base / "probe"):
        os.unlink(cache.base / "probe" / n)
    os.rmdir(cache.base / "probe")
    os.symlink(elsewhere, cache.base / "probe")
    with registered(_folder()):
        with pytest.raises(NotOwnDirError, match="probe is a symbolic link"):
            hygiene.clear(cache)
        assert any("probe is a symbolic link" in d for d in hygiene.stats(cache)["not_own_dirs"])
    assert os.listdir(elsewhere) == ["keep.rec"]


def test_the_cli_reports_and_removes_a_registered_folder(cache):
    with registered(_folder()):
        r = CliRunner().invoke(main, ["clean", "--all", "--dry-run", "--json", "--cache-dir", str(cache.root)])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["probe_records_removed"] == ["a.rec", "b.rec"]
        r = CliRunner().invoke(main, ["clean", "--all", "--cache-dir", str(cache.root)])
        assert r.exit_code == 0 and "removed probe record a.rec" in r.stdout, r.output
        assert os.listdir(cache.base / "probe") == []


@pytest.mark.parametrize("name", ["", "Gemm", "1st", "a-b", "x" * 41])  # the stats key must be a plain identifier
def test_a_folder_name_is_a_plain_lowercase_identifier(name):
    with pytest.raises(ValueError, match="not a record folder name"):
        _folder(name)


def test_two_folders_under_one_name_are_refused():
    with registered(_folder("gemm_tuning")), pytest.raises(ValueError, match="registered twice.*gemm_tuning"):
        record_folders.folders()


def test_import_musekern_registers_the_gemm_records_without_importing_them():
    code = ("import sys, musekern\n"
            "from musekern.store import record_folders\n"
            "before = 'musekern.gemm.records' in sys.modules\n"
            "names = [f.name for f in record_folders.folders()]\n"
            "print(before, names, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "False ['gemm_tuning'] False"
