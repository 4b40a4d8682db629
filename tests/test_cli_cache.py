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
from store_fakes import (
    FAKE_ABI,
    OWN_DIRS,
    abi_json,
    as_other_user,
    fail_writes_under,
    fake_symbol,
    lived_in,
    lock_held_elsewhere,
    plant_outside,
    tree,
)

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
    return cache.put(p, cubin, {"kernel": p.kernel, "label": p.label, "variant": p.variant_params,
                                "symbol": fake_symbol(p.kernel, p.variant_params, "k"),
                                "arch": p.arch, "abi": abi_json(p.kernel, p.variant_params), "built_with": {}})


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
    # a missing file, /dev/null (five lines before: one per tarfile method), /dev/zero, a FIFO (never waited on)
    # and a directory: one line each
    os.mkfifo(tmp_path / "fifo")
    for what in (tmp_path / "missing.tar", "/dev/null", "/dev/zero", tmp_path / "fifo", tmp_path):
        r = cli("import", what, "--cache-dir", tmp_path / "d")
        assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("musekern: error:"), \
            r.stderr


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


# ---------------------------------------------------------------- issue 28's bundle items
def test_export_refuses_an_output_name_it_does_not_write(cli, filled, tmp_path):
    for name in ("x.zip", "x.tar.xz", "x", ".tar"):
        r = cli("export", "--all", "-o", tmp_path / name, "--cache-dir", filled.root)
        assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1 and ".tar.gz" in r.stderr
        assert not (tmp_path / name).exists()
    for name in ("x.tar", "x.tar.gz", "x.tgz"):
        assert cli("export", "--all", "-o", tmp_path / name, "--cache-dir", filled.root).exit_code == 0


def test_export_all_names_a_damaged_entry_it_skips_and_exits_1(cli, filled, tmp_path):
    damaged = fake_parts(1).key()
    mf = filled.entry_path(damaged) / "manifest.json"
    os.chmod(mf, 0o644)
    mf.write_bytes(b"{not json")
    r = cli("export", "--all", "-o", tmp_path / "b.tar", "--cache-dir", filled.root, "--json")
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert out["entries"] == 3 and out["skipped"] == [damaged] and not out["ok"]
    warned = [ln for ln in r.stderr.splitlines() if "skipping damaged entry" in ln]
    assert len(warned) == 1 and damaged[:16] in warned[0] and "musekern verify --repair" in r.stderr
    assert cli("import", tmp_path / "b.tar", "--cache-dir", tmp_path / "d").exit_code == 0


def test_verify_refuses_a_cubin_of_another_arch(cli, tmp_path):
    """An sm_100a cubin re-sealed under an sm_90a key (the loader refuses it; verify now does too)."""
    from cubin_headers import elf_header

    from musekern.store.manifest import manifest_bytes, seal

    c = Cache(tmp_path / "c")
    p = fake_parts(0)
    e = c.put(p, elf_header("sm_90a", b"body"), {"kernel": p.kernel, "label": p.label, "variant": p.variant_params,
                                               "symbol": "k", "arch": p.arch, "abi": FAKE_ABI.to_json()})
    assert cli("verify", "--cache-dir", c.root).exit_code == 0
    other = elf_header("sm_100a", b"body")
    for f, data in (("kernel.cubin", other), ("manifest.json", manifest_bytes(seal(
            {**e.manifest, "cubin_sha256": hashlib.sha256(other).hexdigest(), "cubin_size": len(other)})))):
        os.chmod(e.path / f, 0o644)
        (e.path / f).write_bytes(data)
    r = cli("verify", "--cache-dir", c.root)
    assert r.exit_code == 1 and "built for sm_100a, the entry's arch is sm_90a" in r.stdout


# ---------------------------------------------------------------- issue 28: no deletes outside the cache
# every maintenance command (dry runs too: they must say what the real run would do) x every directory the store
# makes, planted as a link to an outside directory of sentinels named as that directory's items would be. Before
# the fix: `clean` emptied a linked tmp/ (25 of 25 sentinels), `clean --all` deleted 21 through plans/ or used/
# and 4 through entries/, `verify --repair` 4 through entries/, `stats --zero` 4 through stats/, `gc` 4 through
# used/, and a linked v2/ lost 1-23 files to every command.
MAINTENANCE = [("clean",), ("clean", "--all"), ("clean", "--stale"), ("clean", "--all", "--dry-run"),
               ("gc", "--max-size", "0"), ("gc", "--older-than", "0s"), ("gc", "--max-size", "0", "--dry-run"),
               ("stats", "--zero"), ("verify", "--repair")]


@pytest.mark.parametrize("rel", OWN_DIRS)
@pytest.mark.parametrize("args", MAINTENANCE, ids=" ".join)
def test_maintenance_never_deletes_or_writes_through_a_planted_link(cli, tmp_path, rel, args):
    cache, keys = lived_in(tmp_path / "cache")
    outside = tmp_path / "outside"
    planted = plant_outside(cache, rel, outside, keys)
    before = tree(outside)
    r = cli(*args, "--cache-dir", cache.root)
    assert tree(outside) == before  # 0 outside files removed, changed or created
    err = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(err) == 1, (r.exit_code, r.stderr)
    assert f"{planted} is a symbolic link to {outside}" in err[0] and f"rm {planted}" in err[0], err
    # the fix it names works: the link goes (never what it points at), and the command runs
    planted.unlink()
    no_plan_left = args == ("clean", "--stale") and rel in ("v2", "v2/plans")  # "no plan is recorded": exit 1
    assert cli(*args, "--cache-dir", cache.root).exit_code == int(no_plan_left) and tree(outside) == before


def test_stats_warns_of_a_planted_link_and_reads_nothing_through_it(cli, tmp_path):
    cache, keys = lived_in(tmp_path / "cache")
    plant_outside(cache, "v2/tmp", tmp_path / "outside", keys)
    r = cli("stats", "--cache-dir", cache.root, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["staging"] == {"live": 0, "debris": 0, "debris_bytes": 0}
    assert doc["not_own_dirs"] == [f"{cache.tmp_dir} is a symbolic link to {tmp_path / 'outside'}"]
    assert "refuses this cache" in r.stderr


# ---------------------------------------------------------------- issue 28: a damaged policy.json
# every way the size policy can be damaged (the five, plus what its bounded reader must also refuse) x the
# three commands that read it. prepare and stats do not need it (everything is present; stats only shows it): one
# warning line, exit 0, no policy applied; a plain `gc` trims to it: one error line, exit 1; `gc --max-size` does not
# need it: exit 0. Before the fix, 18/18 of the runs ended in a traceback (read_regular's ReadProblem was
# not caught); bad JSON or wrong types made `stats` fail (exit 1) although it does not need the policy.
POLICY_DAMAGE = ["directory", "fifo", "symlink", "dev_zero", "too_large", "bad_json", "string", "negative",
                 "bool", "list", "no_key", "nested", "huge_number", "utf16"]


def _damage_policy(path: Path, how: str, tmp_path: Path) -> None:
    good = json.dumps({"max_size": 10**9})
    if how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "symlink":  # even to a good policy: the store reads regular files only, no links
        (tmp_path / "elsewhere.json").write_text(good)
        path.symlink_to(tmp_path / "elsewhere.json")
    elif how == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes({"too_large": good.encode() + b" " * (1 << 17), "bad_json": b'{"max_size": ',
                          "string": b'{"max_size": "2G"}', "negative": b'{"max_size": -1}',
                          "bool": b'{"max_size": true}', "list": b"[1]", "no_key": b"{}",
                          "nested": b"[" * 100_000 + b"]" * 100_000, "huge_number": b'{"max_size": 1' + b"0" * 5000
                          + b"}", "utf16": good.encode("utf-16")}[how])


def _policy_run(args, root: Path, prefix=None) -> tuple[int, str, str]:
    """`musekern ARGS --cache-dir ROOT`, prepare's builds faked: here, or in a child run as `prefix` (another user)."""
    if prefix is None:
        from store_fakes import fake_builds

        from musekern.cli import main

        with pytest.MonkeyPatch.context() as mp:
            fake_builds(mp)
            r = CliRunner().invoke(main, [*args, "--cache-dir", str(root)])
        crash = r.exception is not None and not isinstance(r.exception, SystemExit)
        return r.exit_code, r.stdout, r.stderr + ("Traceback: " + repr(r.exception) if crash else "")
    code = ("import sys, pytest; sys.path.insert(0, 'tests'); import store_fakes; "
            "store_fakes.fake_builds(pytest.MonkeyPatch()); from musekern.cli import main; "
            "main(sys.argv[1:], prog_name='musekern')")
    env = {k: v for k, v in os.environ.items() if k != "MUSEKERN_MAX_SIZE"}
    r = subprocess.run([*prefix, sys.executable, "-c", code, *args, "--cache-dir", str(root)], capture_output=True,
                       text=True, timeout=120, cwd=Path(__file__).resolve().parents[1], env=env)
    return r.returncode, r.stdout, r.stderr


POLICY_COMMANDS = {"prepare": (("prepare", "--target", "h200", "--variant",
                                "qk_norm[dtype=bfloat16,has_scale=False,head_dim=64]"), 0, "warning"),
                   "stats": (("stats",), 0, "warning"), "gc": (("gc",), 1, "error"),
                   "gc --max-size": (("gc", "--max-size", "1G"), 0, None)}


def _policy_cache(root: Path) -> Cache:
    c = Cache(root)
    code, _, err = _policy_run(POLICY_COMMANDS["prepare"][0], root)  # everything present: prepare needs nothing
    assert code == 0, err
    return c


@pytest.mark.parametrize("how", POLICY_DAMAGE)
def test_a_damaged_size_policy_is_one_line_never_a_traceback(tmp_path, monkeypatch, how):
    monkeypatch.delenv("MUSEKERN_MAX_SIZE", raising=False)
    c = _policy_cache(tmp_path / "cache")
    _damage_policy(c.policy_path, how, tmp_path)
    for name, (args, want, level) in POLICY_COMMANDS.items():
        code, out, err = _policy_run(args, c.root)
        lines = [ln for ln in err.splitlines() if "size policy" in ln]
        assert code == want and "Traceback" not in err, (how, name, code, err[-2000:])
        if level is not None:
            assert len(lines) == 1 and lines[0].startswith(f"musekern: {level}: ") and str(c.policy_path) in lines[0]
            assert "musekern gc --set-max-size" in lines[0] and len(lines[0]) < 1000, (how, name, lines)
    assert len(c.entries()) == 1  # nothing was evicted by a policy that could not be read


def test_an_unreadable_size_policy_is_one_line(world_dir, monkeypatch):
    """chmod 000 for real: as root the commands run as `nobody`, who owns the cache but not policy.json."""
    monkeypatch.delenv("MUSEKERN_MAX_SIZE", raising=False)
    prefix = as_other_user()
    c = _policy_cache(world_dir / "cache")
    c.policy_path.write_text(json.dumps({"max_size": 1}))
    os.chmod(c.policy_path, 0o000)
    if prefix:
        for d, dirs, files in os.walk(c.root):
            for n in [d, *(os.path.join(d, x) for x in dirs + files)]:
                if n != str(c.policy_path):
                    os.chown(n, 65534, 65534, follow_symlinks=False)
    for name, (args, want, level) in POLICY_COMMANDS.items():
        code, _, err = _policy_run(args, c.root, prefix)
        lines = [ln for ln in err.splitlines() if "size policy" in ln]
        assert code == want and "Traceback" not in err, (name, code, err[-2000:])
        if level is not None:
            assert len(lines) == 1 and "permission denied" in lines[0] and str(c.policy_path) in lines[0], lines
    assert len(c.entries()) == 1


# ---------------------------------------------------------------- issue 28, finding 8 (store and CLI side)
def test_clean_all_beside_a_held_tuning_lock_says_so_at_once(cli, filled):
    """Before: 20 s of silence (the tuning lock waited for twice, 10 s each), then the records kept unsaid."""
    import fcntl

    from musekern.gemm import records

    records.tuning_dir(filled).mkdir()
    record = records.tuning_dir(filled) / "gpu.sm90.132sms.cublaslt1.json"
    record.write_text("{}")
    fd = os.open(records.lock_path(filled), os.O_RDWR | os.O_CREAT)  # another open file description: a writer
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        r = cli("clean", "--all", "--cache-dir", filled.root, "--json")
        took = time.monotonic() - t0
    finally:
        os.close(fd)
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and took < 3 and len(doc["removed"]) == 4 and record.exists(), took
    assert len(doc["skipped"]) == 1 and str(records.lock_path(filled)) in doc["skipped"][0]
    assert r.stderr.count("\n") == 1 and "GEMM tuning records kept" in r.stderr and "clean --all" in r.stderr
    assert cli("clean", "--all", "--cache-dir", filled.root).exit_code == 0 and not record.exists()


def test_clean_all_without_a_locks_dir_removes_the_tuning_records(cli, filled):
    """Before: the tuning lock could not be made without locks/, and the records were kept, silently."""
    from musekern.gemm import records

    records.tuning_dir(filled).mkdir()
    (records.tuning_dir(filled) / "gpu.sm90.132sms.cublaslt1.json").write_text("{}")
    import shutil

    shutil.rmtree(filled.locks_dir)
    r = cli("clean", "--all", "--cache-dir", filled.root, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["gemm_tuning_removed"] == ["gpu.sm90.132sms.cublaslt1"]
    assert os.listdir(records.tuning_dir(filled)) == []


# a lock file that is no file: a directory (the issue's), a link to one, a FIFO; each maintenance command that
# takes entry locks. Before: `gc` stopped at the first such key with an error (entries after it never collected).
@pytest.mark.parametrize("how", ["directory", "symlink", "fifo"])
@pytest.mark.parametrize("args", [("gc", "--max-size", "0"), ("clean", "--all"), ("clean", "--stale")], ids=" ".join)
def test_a_lock_file_that_is_not_a_file_skips_its_entry_in_one_line(cli, filled, tmp_path, how, args):
    hygiene.record_plan(filled, "p", [fake_parts(9).key()])  # a plan that needs none of them: all stale
    key = sorted(e.key for e in filled.entries())[0]
    lock = filled.locks_dir / f"{key}.lock"
    lock.unlink()
    if how == "directory":
        lock.mkdir()
    elif how == "symlink":
        (tmp_path / "elsewhere").mkdir()
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(lock)
    r = cli(*args, "--cache-dir", filled.root, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and [e.key for e in filled.entries()] == [key], r.stderr  # the others went
    assert len(doc["skipped"]) == 1 and r.stderr.count("\n") == 1 and f"rm -r {lock}" in r.stderr, r.stderr
    assert doc.get("busy", []) == []  # skipped for its lock file, not held by a running prepare
    assert f"entry {key[:16]} kept" in r.stderr and f"musekern {args[0]}" in r.stderr


@pytest.mark.parametrize("query,msg", [("25c9", "'25c9' is too short: give at least 6 hex digits of the key (2 entries "
                                               "start with it"), ("25c9ab", "'25c9ab' is ambiguous: 2 entries start")])
def test_explain_a_short_or_ambiguous_key_prefix_says_so(cli, tmp_path, query, msg):
    """Before: `explain 25c9` said "no entry labelled '25c9'"; an ambiguous prefix printed click's usage block."""
    c = Cache(tmp_path / "cache")
    put(c, fake_parts(0))
    for tail in ("0", "1"):  # two entry directories whose keys share 25c9ab (uncommitted: explain matches them too)
        (c.entries_dir / ("25c9ab" + tail * 58)).mkdir()
    r = cli("explain", query, "--cache-dir", c.root)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and msg in r.stderr, r.stderr
    assert "no entry labelled" not in r.stderr and "Usage:" not in r.stderr


# a plan record that is no file (hostile input found while testing finding 2): before, stats, gc, stats --zero and
# clean --stale ended in a traceback (read_regular's ReadProblem was not caught); now the record is skipped
@pytest.mark.parametrize("how", ["symlink", "fifo", "directory"])
@pytest.mark.parametrize("args", [("stats",), ("stats", "--zero"), ("gc", "--max-size", "1G"), ("clean", "--stale")],
                         ids=" ".join)
def test_a_plan_record_that_is_no_file_is_skipped(cli, filled, tmp_path, how, args):
    hygiene.record_plan(filled, "p", [e.key for e in filled.entries()])
    bad = filled.plans_dir / "evil.0123456789ab.json"
    if how == "symlink":
        (tmp_path / "elsewhere.json").write_text(json.dumps({"name": "x", "keys": []}))
        bad.symlink_to(tmp_path / "elsewhere.json")
    elif how == "fifo":
        os.mkfifo(bad)
    else:
        bad.mkdir()
    r = cli(*args, "--cache-dir", filled.root)
    assert r.exit_code == 0 and len(filled.entries()) == 4, r.output
    assert hygiene.plans(filled) == {"p": sorted(e.key for e in filled.entries())}
