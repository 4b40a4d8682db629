"""The cache commands through click's CliRunner on a group of our own (no console script needed).

Checked for every command: --json on stdout, messages on stderr, exit 0 ok / 1 failure /
2 usage, and an error that names the fixing command.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from store_fakes import FAKE_ABI, as_other_user, fail_writes_under, lock_held_elsewhere

from musekern.cli import cache_cmds
from musekern.cli.cache_cmds import parse_duration, parse_size
from musekern.store import hygiene
from musekern.store.cache import Cache
from musekern.store.keys import KeyParts

SRC = "ab" * 32


@pytest.fixture
def cli():
    group = click.Group("musekern")
    cache_cmds.register(group)
    runner = CliRunner()

    def run(*args):
        return runner.invoke(group, [str(a) for a in args], catch_exceptions=False)
    return run


def fake_parts(i: int, kernel="qk_norm", arch="sm_90a", dsl="4.8.1") -> KeyParts:
    return KeyParts.make(kernel, {"dtype": "bfloat16", "head_dim": 64, "has_scale": bool(i % 2), "i": i}, arch, SRC,
                         dsl, 1)


def put(cache: Cache, p: KeyParts):
    cubin = b"\x7fELF" + hashlib.sha256(p.key().encode()).digest() * 4
    return cache.put(p, cubin, {"kernel": p.kernel, "label": p.label, "variant": p.variant_params, "symbol": "k",
                                "arch": p.arch, "abi": FAKE_ABI.to_json(), "built_with": {}})


@pytest.fixture
def filled(tmp_path):
    c = Cache(tmp_path / "cache")
    for i in range(3):
        put(c, fake_parts(i))
    put(c, fake_parts(3, kernel="qkv_front", arch="sm_100a"))
    return c


def test_all_commands_registered_with_json_and_cache_dir():
    group = click.Group("g")
    cache_cmds.register(group)
    assert set(group.commands) == {"ls", "verify", "clean", "stats", "gc", "explain", "export", "import"}
    for cmd in group.commands.values():
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert {"--json", "--cache-dir"} <= opts, cmd.name


def test_ls(cli, filled):
    r = cli("ls", "--cache-dir", filled.root, "--json")
    assert r.exit_code == 0
    entries = json.loads(r.stdout)["entries"]
    assert [e["key"] for e in entries] == sorted(e.key for e in filled.entries())
    assert {"key", "kernel", "arch", "label", "size_bytes"} <= set(entries[0])
    r = cli("ls", "--cache-dir", filled.root, "--arch", "sm_100a")
    assert r.exit_code == 0 and "qkv_front" in r.stdout and "qk_norm[" not in r.stdout
    assert "1 entries in" in r.stdout  # the summary of the result goes with it (cli/__init__.py)


def test_ls_and_stats_of_missing_cache(cli, tmp_path):
    assert json.loads(cli("ls", "--cache-dir", tmp_path / "none", "--json").stdout)["entries"] == []
    s = json.loads(cli("stats", "--cache-dir", tmp_path / "none", "--json").stdout)
    assert s["entries"] == 0 and s["bytes"] == 0
    assert not (tmp_path / "none").exists()  # reading creates nothing


def test_cache_dir_from_env(cli, filled, monkeypatch):
    monkeypatch.setenv("MUSEKERN_CACHE_DIR", str(filled.root))
    assert len(json.loads(cli("ls", "--json").stdout)["entries"]) == 4


def test_verify_and_repair(cli, filled):
    r = cli("verify", "--cache-dir", filled.root)
    assert r.exit_code == 0 and "4 entries checked, 0 bad" in r.stdout
    bad = filled.get(fake_parts(1).key())
    os.chmod(bad.cubin_path, 0o644)
    bad.cubin_path.write_bytes(b"\x7fELF")
    r = cli("verify", "--cache-dir", filled.root, "--json")
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert not out["ok"] and [b["key"] for b in out["bad"]] == [bad.key] and out["removed"] == []
    assert "musekern verify --repair" in r.stderr
    r = cli("verify", "--cache-dir", filled.root)
    assert r.exit_code == 1 and f"BAD {bad.key}" in r.stdout
    r = cli("verify", "--repair", "--cache-dir", filled.root)
    assert r.exit_code == 0 and "1 removed" in r.stdout and "musekern prepare" in r.stderr
    assert filled.get(bad.key) is None and len(filled.entries()) == 3
    assert cli("verify", "--cache-dir", filled.root).exit_code == 0


def test_stats(cli, filled):
    r = cli("stats", "--cache-dir", filled.root, "--json")
    s = json.loads(r.stdout)
    assert r.exit_code == 0 and s["entries"] == 4
    assert s["by_kernel"]["qk_norm"]["entries"] == 3 and s["by_arch"]["sm_100a"]["entries"] == 1
    r = cli("stats", "--cache-dir", filled.root)
    assert r.exit_code == 0 and "4 entries" in r.stdout and "qkv_front" in r.stdout


def test_gc(cli, filled):
    now = time.time()
    keys = [fake_parts(i).key() for i in range(3)]
    for age, k in zip((40, 10, 1), keys, strict=True):
        filled.touch(k)
        os.utime(filled.used_dir / k, (now - age * 86400,) * 2)
    r = cli("gc", "--cache-dir", filled.root, "--older-than", "30d", "--json")
    assert r.exit_code == 0 and [e["key"] for e in json.loads(r.stdout)["removed"]] == [keys[0]]
    r = cli("gc", "--cache-dir", filled.root, "--max-size", "1", "--dry-run")
    assert r.exit_code == 0 and "would be removed" in r.stdout and len(filled.entries()) == 3
    before = hygiene.stats(filled)
    r = cli("gc", "--cache-dir", filled.root, "--max-size", "1", "--dry-run", "--json")
    doc = json.loads(r.stdout)  # what would be LEFT, not today's totals
    assert doc["entries_left"] == before["entries"] - len(doc["removed"]) and doc["removed"]
    assert doc["bytes_left"] == before["bytes"] - sum(e["size_bytes"] for e in doc["removed"])
    r = cli("gc", "--cache-dir", filled.root, "--max-size", "1GiB")
    assert r.exit_code == 0 and len(filled.entries()) == 3
    assert cli("gc", "--cache-dir", filled.root).exit_code == 2  # needs an option
    assert cli("gc", "--cache-dir", filled.root, "--max-size", "lots").exit_code == 2
    assert cli("gc", "--cache-dir", filled.root, "--older-than", "soon").exit_code == 2


def test_size_and_duration_parsing():
    assert parse_size("500M") == 500 * 10**6 and parse_size("1GiB") == 2**30 and parse_size("1024") == 1024
    assert parse_duration("30d") == 30 * 86400 and parse_duration("1d12h") == 36 * 3600
    for bad in ("", "10x", "abc"):
        with pytest.raises(ValueError):
            parse_size(bad)
    for bad in ("", "10", "5y", "1d junk", "1.5.5d", "d1"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_clean_stale_and_all(cli, filled):
    r = cli("clean", "--stale", "--cache-dir", filled.root)
    assert r.exit_code == 1 and "no plan is recorded" in r.stderr and "musekern prepare" in r.stderr
    keep = [fake_parts(0).key(), fake_parts(1).key()]
    hygiene.record_plan(filled, "cfg|h200", keep)
    r = cli("clean", "--stale", "--dry-run", "--cache-dir", filled.root, "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["removed"]) == 2 and len(filled.entries()) == 4
    r = cli("clean", "--stale", "--cache-dir", filled.root)
    assert r.exit_code == 0 and sorted(e.key for e in filled.entries()) == sorted(keep)
    r = cli("clean", "--all", "--cache-dir", filled.root, "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["removed"]) == 2 and filled.entries() == []


def test_explain_key_and_label(cli, filled):
    p = fake_parts(2)
    r = cli("explain", p.key()[:12], "--cache-dir", filled.root)
    assert r.exit_code == 0
    for word in ("kernel", "variant", "arch", "source", "dsl_version", "abi_version", "integrity: ok", p.key()):
        assert word in r.stdout
    r = cli("explain", p.key(), "--cache-dir", filled.root, "--json")
    out = json.loads(r.stdout)
    assert out["entry"]["parts"] == p.to_json() and out["problems"] == []
    r = cli("explain", p.label, "--cache-dir", filled.root, "--json")
    assert r.exit_code == 0 and [e["key"] for e in json.loads(r.stdout)["entries"]] == [p.key()]
    r = cli("explain", "0" * 64, "--cache-dir", filled.root)
    assert r.exit_code == 1 and "musekern ls" in r.stderr
    r = cli("explain", "qk_norm[nothing=1]", "--cache-dir", filled.root)
    assert r.exit_code == 1


def _plan_parts(target="h200", dsl=None):
    from musekern.config import load_config
    from musekern.plan import plan_model
    from musekern.store.keys import dsl_version, key_parts
    from musekern.targets import get_target

    plan = plan_model(load_config(None), [get_target(target)])
    return [(pe, key_parts(pe, pe.arch, dsl or dsl_version())) for pe in plan]


def test_explain_planned_variant_names_the_differing_part(cli, tmp_path):
    """A planned variant that is missing: the nearest entry and the part that differs are named."""
    c = Cache(tmp_path / "c")
    pe, parts = _plan_parts()[0]
    older = KeyParts.make(parts.kernel, parts.variant_params, parts.arch, parts.source_sha256, "0.0.1",
                          parts.abi_version)
    put(c, older)
    r = cli("explain", pe.variant.label, "--target", "h200", "--cache-dir", c.root, "--json")
    assert r.exit_code == 0, r.output
    planned = json.loads(r.stdout)["planned"]
    assert planned[0]["present"] is False and planned[0]["differs_in"] == ["dsl_version"]
    r = cli("explain", pe.variant.label, "--target", "h200", "--cache-dir", c.root)
    assert "MISSING" in r.stdout and "dsl_version" in r.stdout and "musekern prepare --target h200" in r.stderr


def test_export_model_plan_and_import(cli, tmp_path):
    src = Cache(tmp_path / "src")
    pp = _plan_parts()
    out = tmp_path / "b.tar"
    r = cli("export", "--target", "h200", "-o", out, "--cache-dir", src.root)
    assert r.exit_code == 1 and "musekern prepare" in r.stderr and "--target h200" in r.stderr
    for _, p in pp:
        put(src, p)
    r = cli("export", "--target", "h200", "-o", out, "--cache-dir", src.root, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["entries"] == len(pp) and out.exists()
    dst = tmp_path / "dst"
    r = cli("import", out, "--cache-dir", dst, "--json")
    res = json.loads(r.stdout)
    assert r.exit_code == 0 and res["ok"] and len(res["added"]) == len(pp) and res["plan"]
    r = cli("import", out, "--cache-dir", dst)
    assert r.exit_code == 0 and f"0 added, {len(pp)} already present" in r.stdout
    # the recorded plan makes clean --stale meaningful on the importing machine
    assert cli("clean", "--stale", "--cache-dir", dst, "--json").exit_code == 0
    assert len(Cache(dst).entries()) == len(pp)


def test_export_all_and_keys(cli, filled, tmp_path):
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    assert cli("export", "--all", "-o", a, "--cache-dir", filled.root).exit_code == 0
    k = fake_parts(0).key()
    assert cli("export", "--key", k[:10], "-o", b, "--cache-dir", filled.root).exit_code == 0
    assert cli("export", "--key", "ffffffffff", "-o", b, "--cache-dir", filled.root).exit_code == 1
    assert cli("export", "--all", "--target", "h200", "-o", b, "--cache-dir", filled.root).exit_code == 2
    assert cli("export", "--all", "--cache-dir", filled.root).exit_code == 2  # -o is required
    r = cli("import", a, "--cache-dir", tmp_path / "d", "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["added"]) == 4


def test_import_bad_bundle_exits_1(cli, tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"nope" * 300)
    r = cli("import", bad, "--cache-dir", tmp_path / "d")
    assert r.exit_code == 1 and "musekern export" in r.stderr
    assert cli("import", tmp_path / "missing.tar", "--cache-dir", tmp_path / "d").exit_code == 2


def test_writes_on_read_only_cache_fail_with_one_line(cli, tmp_path):
    ro = tmp_path / "ro"
    put(Cache(ro), fake_parts(0))
    for dirpath, _, _ in os.walk(ro):
        os.chmod(dirpath, 0o555)  # no write bit: read-only for root too (the store holds itself to mode bits)
    try:
        for args in (("clean", "--all"), ("gc", "--max-size", "1"), ("clean",)):
            r = cli(*args, "--cache-dir", ro)
            assert r.exit_code == 1 and "read-only" in r.stderr and len(r.stderr.strip().splitlines()) == 1, args
        assert cli("ls", "--cache-dir", ro).exit_code == 0  # reading still works
        assert cli("verify", "--cache-dir", ro).exit_code == 0
    finally:
        for dirpath, _, _ in os.walk(ro):
            os.chmod(dirpath, 0o755)


# ---------------------------------------------------------------- issues 12 and 15: errors are one line with their fix


def test_gc_max_size_with_400_digits_is_a_usage_error(cli, filled):
    r = cli("gc", "--cache-dir", filled.root, "--max-size", "9" * 400)
    assert r.exit_code == 2 and "--max-size" in r.output


def test_a_cache_dir_that_is_a_file_is_not_a_directory(cli, tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("")
    monkeypatch.setenv("MUSEKERN_CACHE_DIR", str(f))
    for args in (("clean", "--all"), ("gc", "--max-size", "1"), ("verify",)):
        r = cli(*args)
        assert r.exit_code == 1 and "not a directory" in r.stderr and "read-only" not in r.stderr, (args, r.output)


@pytest.mark.parametrize("args,command", [(("clean", "--all"), "clean"), (("gc", "--max-size", "1"), "gc"),
                                          (("verify", "--repair"), "verify --repair")])
def test_read_only_errors_name_the_command_that_was_run(cli, filled, monkeypatch, args, command):
    put(filled, fake_parts(9))
    bad = filled.get(fake_parts(9).key())
    os.chmod(bad.cubin_path, 0o644)
    bad.cubin_path.write_bytes(b"\x7fELF")  # so verify --repair has something to remove
    monkeypatch.setattr(Cache, "read_only", property(lambda self: True))
    r = cli(*args, "--cache-dir", filled.root)
    assert r.exit_code == 1 and "read-only" in r.stderr and f"musekern {command}" in r.stderr
    assert "musekern prepare" not in r.stderr, r.stderr


def test_import_into_a_read_only_cache_names_import(cli, filled, tmp_path, monkeypatch):
    out = tmp_path / "b.tar"
    assert cli("export", "--all", "-o", out, "--cache-dir", filled.root).exit_code == 0
    monkeypatch.setattr(Cache, "read_only", property(lambda self: True))
    r = cli("import", out, "--cache-dir", tmp_path / "other")
    assert r.exit_code == 1 and "musekern import" in r.stderr and "musekern prepare" not in r.stderr


def test_verify_of_a_missing_cache_dir_fails(cli, tmp_path):
    r = cli("verify", "--cache-dir", tmp_path / "typo")
    assert r.exit_code == 1 and str(tmp_path / "typo") in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_ls_marks_entries_that_do_not_verify(cli, filled):
    bad = filled.get(fake_parts(1).key())
    os.chmod(bad.cubin_path, 0o644)
    bad.cubin_path.write_bytes(b"\x7fELF")
    cubinless = filled.get(fake_parts(2).key())
    os.unlink(cubinless.cubin_path)
    doc = json.loads(cli("ls", "--cache-dir", filled.root, "--json").stdout)
    state = {e["key"]: e["ok"] for e in doc["entries"]}
    assert state[bad.key] is False and state[cubinless.key] is False and state[fake_parts(0).key()] is True
    r = cli("ls", "--cache-dir", filled.root)
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln[:16] in (bad.key[:16], cubinless.key[:16])}
    assert all("BAD" in row for row in rows.values()) and len(rows) == 2


def test_clean_dry_run_never_says_removed(cli, filled):
    (filled.tmp_dir / f"{fake_parts(5).key()}.1.dead").mkdir(parents=True)
    hygiene.record_plan(filled, "p", [fake_parts(0).key()])
    for args in (("clean", "--dry-run"), ("clean", "--stale", "--dry-run"), ("clean", "--all", "--dry-run")):
        r = cli(*args, "--cache-dir", filled.root)
        assert r.exit_code == 0 and " removed" not in r.stdout.replace("would be removed", ""), (args, r.stdout)


@pytest.mark.parametrize("args", [("ls",), ("verify",), ("stats",), ("gc", "--max-size", "1"), ("clean",),
                                  ("explain", "qk_norm[dtype=bfloat16]"), ("import", "BUNDLE")])
def test_an_unreadable_cache_dir_is_one_line_naming_it(world_dir, args):
    """A cache directory this user may not read (PermissionError): one error line naming the path and the fix,
    exit 1, never a traceback. As root the command runs as `nobody` (root reads through mode bits)."""
    c = Cache(world_dir / "cache")
    put(c, fake_parts(0))
    bundle = world_dir / "b.tar"
    from musekern.store.bundle import export_bundle

    export_bundle(c, [fake_parts(0).key()], bundle)
    os.chmod(bundle, 0o644)
    os.chmod(c.root, 0o700)  # the other user can neither list nor enter it
    args = [str(bundle) if a == "BUNDLE" else a for a in args]
    code = ("import sys; from musekern.cli.cache_cmds import register; import click; g = click.Group('musekern'); "
            "register(g); g(sys.argv[1:], prog_name='musekern')")
    # through MUSEKERN_CACHE_DIR: click itself refuses an unreadable --cache-dir (a usage error, exit 2)
    r = subprocess.run([*as_other_user(), sys.executable, "-c", code, *args], capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parents[1],
                       env={**os.environ, "MUSEKERN_CACHE_DIR": str(c.root)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert str(c.root) in lines[0] and "ermission" in lines[0], lines


def test_gc_keeps_a_lasting_size_policy(cli, filled, monkeypatch):
    """`gc --set-max-size` writes the policy and trims to it; a plain `gc` then works without flags."""
    monkeypatch.delenv("MUSEKERN_MAX_SIZE", raising=False)
    assert cli("gc", "--cache-dir", filled.root).exit_code == 2  # no policy yet: say what to pass
    limit = hygiene.stats(filled)["bytes"] - 1  # one byte less than the four entries: one must go
    r = cli("gc", "--set-max-size", str(limit), "--cache-dir", filled.root, "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["removed"]) == 1 and len(filled.entries()) == 3
    put(filled, fake_parts(7))
    r = cli("gc", "--cache-dir", filled.root, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["max_size"] == limit and doc["bytes_left"] <= limit
    s = json.loads(cli("stats", "--cache-dir", filled.root, "--json").stdout)
    assert (s["max_size"], s["max_size_source"]) == (limit, "policy.json")
    assert cli("gc", "--set-max-size", "none", "--cache-dir", filled.root).exit_code == 0
    assert cli("gc", "--cache-dir", filled.root).exit_code == 2
    assert cli("gc", "--set-max-size", "2G", "--dry-run", "--cache-dir", filled.root).exit_code == 2


def test_stats_shows_counters_and_staging(cli, filled):
    hygiene.count(filled, "hit")
    hygiene.count(filled, "miss")
    (filled.tmp_dir / f"{fake_parts(9).key()}.1.dead").mkdir(parents=True)
    r = cli("stats", "--cache-dir", filled.root)
    assert r.exit_code == 0 and "1 hit, 1 missed (50% hits)" in r.stdout and "1 of dead writers" in r.stdout
    assert "musekern clean" in r.stderr
    s = json.loads(cli("stats", "--zero", "--cache-dir", filled.root, "--json").stdout)
    assert s["counters"] == {"hit": 0, "miss": 0, "built": 0, "pulled": 0} and s["staging"]["debris"] == 1
    assert cli("clean", "--cache-dir", filled.root).exit_code == 0
    assert json.loads(cli("stats", "--cache-dir", filled.root, "--json").stdout)["staging"]["debris"] == 0


def test_clean_all_keeps_what_a_running_prepare_holds(cli, filled):
    key = fake_parts(0).key()
    with lock_held_elsewhere(filled, key):
        r = cli("clean", "--all", "--cache-dir", filled.root, "--json")
        doc = json.loads(r.stdout)
        assert r.exit_code == 0 and doc["busy"] == [key] and len(doc["removed"]) == 3
    assert [e.key for e in filled.entries()] == [key]


def test_import_onto_a_full_disk_names_what_was_not_stored(cli, filled, tmp_path, monkeypatch):
    out = tmp_path / "b.tar"
    assert cli("export", "--all", "-o", out, "--cache-dir", filled.root).exit_code == 0
    dst = tmp_path / "dst"
    fail_writes_under(monkeypatch, dst)
    r = cli("import", out, "--cache-dir", dst, "--json")
    monkeypatch.undo()
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and len(doc["failed"]) == 4 and not doc["added"]
    assert all("no space left" in f["reason"] and str(dst) in f["reason"] for f in doc["failed"])
    assert "musekern import" in r.stderr and Cache(dst).audit() == {}
