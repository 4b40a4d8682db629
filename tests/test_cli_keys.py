"""`musekern keys` and the signing flow through the CLI: generate a key, export signed, import on a machine that
trusts it (and on one that trusts another key, or none)."""
from __future__ import annotations

import json
import stat

import pytest
from click.testing import CliRunner
from store_fakes import fake_parts, filled

from musekern.cli import main


@pytest.fixture
def run(monkeypatch):
    monkeypatch.delenv("MUSEKERN_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("MUSEKERN_SIGN_KEY", raising=False)
    runner = CliRunner()

    def invoke(*args, env=None):
        return runner.invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)
    return invoke


def test_generate_writes_a_0600_key_prints_its_public_half_and_never_overwrites(run, tmp_path):
    r = run("keys", "generate", "ci.example.org-1", "-o", tmp_path / "ci.sec")
    assert r.exit_code == 0 and r.stdout.startswith("ci.example.org-1:") and len(r.stdout.splitlines()) == 1
    assert stat.S_IMODE((tmp_path / "ci.sec").stat().st_mode) == 0o600 and "0600" in r.stderr
    assert run("keys", "public", tmp_path / "ci.sec").stdout == r.stdout
    again = run("keys", "generate", "other", "-o", tmp_path / "ci.sec")
    assert again.exit_code == 1 and len(again.stderr.splitlines()) == 1 and "never overwritten" in again.stderr
    bad = run("keys", "generate", "no spaces", "-o", tmp_path / "x.sec", "--json")
    assert bad.exit_code == 1 and not (tmp_path / "x.sec").exists()


def test_sign_on_export_trust_on_import(run, tmp_path):
    pub = run("keys", "generate", "ci-1", "-o", tmp_path / "ci.sec").stdout.strip()
    other = run("keys", "generate", "ci-2", "-o", tmp_path / "ci2.sec").stdout.strip()
    c = filled(tmp_path / "prod", [0, 1])
    signed, unsigned = tmp_path / "signed.tar.gz", tmp_path / "unsigned.tar"
    r = run("export", "--all", "-o", signed, "--cache-dir", c.root, env={"MUSEKERN_SIGN_KEY": str(tmp_path / "ci.sec")})
    assert r.exit_code == 0 and "signed by ci-1" in r.stdout
    assert run("export", "--all", "-o", unsigned, "--cache-dir", c.root).exit_code == 0
    keys = sorted(fake_parts(i).key() for i in (0, 1))
    # trusting ci-1 (env or option): the signed bundle imports, the unsigned one is refused entry by entry
    ok = run("import", signed, "--cache-dir", tmp_path / "a", "--json", env={"MUSEKERN_TRUSTED_KEYS": pub})
    assert ok.exit_code == 0 and sorted(json.loads(ok.stdout)["added"]) == keys
    no = run("import", unsigned, "--cache-dir", tmp_path / "b", "--trusted-keys", pub, "--json")
    assert no.exit_code == 1
    assert [x["reason"] for x in json.loads(no.stdout)["rejected"]] == [
        "not trusted: unsigned: --trusted-keys asks for a signature by ci-1"] * 2
    # trusting only ci-2: ci-1's signature is not enough
    no = run("import", signed, "--cache-dir", tmp_path / "c", "--trusted-keys", other)
    assert no.exit_code == 1 and "signed only by untrusted key ci-1; --trusted-keys trusts ci-2" in no.stdout
    # trusting nothing: both import (integrity and ABI checks only), as before signatures existed
    assert run("import", unsigned, "--cache-dir", tmp_path / "d").exit_code == 0


@pytest.mark.parametrize("args,env,says", [  # mistakes in the key settings: one line, exit 1, before any work
    (("--sign-key", "missing.sec"), {}, "no such file|No such file"),
    ((), {"MUSEKERN_SIGN_KEY": "ci-1:" + "A" * 86 + "=="}, "path of the key file"),
])
def test_bad_sign_key_settings_are_one_line(run, tmp_path, args, env, says):
    import re

    c = filled(tmp_path / "prod", [0])
    r = run("export", "--all", "-o", tmp_path / "b.tar", "--cache-dir", c.root, *args, env=env)
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1 and re.search(says, r.stderr)
    assert not (tmp_path / "b.tar").exists()


def test_bad_trusted_keys_are_one_line(run, tmp_path):
    r = run("import", tmp_path / "x.tar", "--cache-dir", tmp_path / "c", env={"MUSEKERN_TRUSTED_KEYS": "ci-1:nope"})
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1 and "MUSEKERN_TRUSTED_KEYS" in r.stderr
