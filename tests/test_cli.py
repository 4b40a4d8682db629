"""The musekern CLI core (plan, prepare, doctor) through click's CliRunner; exit codes 0/1/2 and --json."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from musekern.cli import main
from musekern.store import keys

HAVE_DSL = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="needs the build extra (nvidia-cutlass-dsl)")
QK = ["--variant", "qk_norm[dtype=bfloat16,has_scale=False,head_dim=64]",
      "--variant", "qk_norm[dtype=bfloat16,has_scale=True,head_dim=128]"]


@pytest.fixture
def run(monkeypatch, tmp_path):
    monkeypatch.setenv("MUSEKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("musekern.cli.common.local_target", lambda: None)  # CI has no GPU; be explicit

    def go(*args, code=0):
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == code, (r.exit_code, r.output, r.stderr if hasattr(r, "stderr") else "")
        return r
    return go


def test_plan_table_and_json(run):
    r = run("plan", "--target", "h200")
    assert "qkv_front" in r.stdout and "2176" in r.stdout and "18 distinct variants" in r.stdout
    doc = json.loads(run("plan", "--target", "h200", "--json").stdout)
    tp8 = [row for row in doc["rows"] if row["tp"] == 8 and row["kernel"] == "qkv_front"]
    assert {(r["N"], r["k_split"], r["tiles"], r["fixed_rows"], r["tokens"]) for r in tp8} == {
        (2176, 2, 1, 0, "1-7"), (2176, 2, 1, 8, "8"), (2176, 2, 2, 0, "9-16")}


def test_plan_without_gpu_uses_config_targets(run):
    doc = json.loads(run("plan", "--json").stdout)
    assert doc["targets"] == ["h200"]


@pytest.mark.parametrize("args,msg", [
    (["plan", "--target", "a100x"], "unknown GPU target 'a100x'"),
    (["prepare", "--target", "h200", "--variant", "nope"], "not a variant label"),
    (["prepare", "--target", "h200", "--shard", "3/2"], "K/N"),
    (["prepare", "--target", "h200", "--upload"], "--upload needs --remote"),
    (["plan", "--no-such-option"], "No such option"),
])
def test_usage_errors_exit_2(run, args, msg):
    r = run(*args, code=2)
    assert msg in r.output


def test_bad_config_exits_2_naming_file_and_key(run, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"hidden_size": 8192, "num_attention_heads": 128, "num_key_value_heads": 8,
                               "head_dim": 128}))
    r = run("plan", "--model", str(cfg), "--target", "h200", code=2)
    assert f"{cfg}: head_dim: must be 64" in r.output


def test_no_target_without_gpu_or_config(run, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"hidden_size": 8192, "num_attention_heads": 128, "num_key_value_heads": 8,
                               "attn_output_gate": True}))
    r = run("prepare", "--model", str(cfg), code=2)
    assert "musekern prepare --target h200" in r.output


def test_prepare_without_build_extra_names_it(run, monkeypatch):
    monkeypatch.setattr("musekern.build.compile.dsl_version", lambda: None)
    monkeypatch.setattr("musekern.build.prepare.dsl_version", lambda: None)
    r = run("prepare", "--target", "h200", *QK, code=1)
    assert "musekern[build]" in r.output


@needs_dsl
def test_prepare_then_warm_rerun_does_nothing(run):
    doc = json.loads(run("prepare", "--target", "h200", *QK, "--json").stdout)
    assert doc["counts"] == {"built": 2, "hit": 0, "pulled": 0, "failed": 0} and doc["ok"]
    r = run("prepare", "--target", "h200", *QK)
    assert "all 2 variants already in the cache; nothing to do" in r.stdout
    doc = json.loads(run("prepare", "--target", "h200", *QK, "--json").stdout)
    assert doc["counts"]["hit"] == 2 and doc["counts"]["built"] == 0


@needs_dsl
def test_doctor_reports_missing_then_ok(run, tmp_path):
    doc = json.loads(run("doctor", "--target", "h200", "--json", code=1).stdout)
    assert doc["nvidia-cutlass-dsl"] == keys.dsl_version() and len(doc["missing"]) == 18 and not doc["ok"]
    assert doc["cache_dir"] == str(tmp_path / "cache")
    r = run("doctor", "--target", "h200", code=1)
    assert "missing from the cache" in r.stdout and "fix: musekern prepare --target h200" in r.stdout


@needs_dsl
def test_two_processes_prepare_one_cache_concurrently(tmp_path):
    """Both succeed; every entry intact (verify), each variant present once."""
    env = {**os.environ, "MUSEKERN_CACHE_DIR": str(tmp_path / "shared")}
    labels = [a for a in QK] + ["--variant", "qk_norm[dtype=float16,has_scale=False,head_dim=256]"]
    cmd = [sys.executable, "-m", "musekern", "prepare", "--target", "h200", "--json", *labels]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1].decode()[-2000:] for o in outs]
    docs = [json.loads(o[0]) for o in outs]
    built = sum(d["counts"]["built"] for d in docs)
    assert built == 3 and all(d["counts"]["failed"] == 0 for d in docs)  # each variant compiled exactly once
    from musekern.store.cache import Cache

    cache = Cache(tmp_path / "shared")
    assert len(cache.entries()) == 3 and all(cache.verify_entry(e) == [] for e in cache.entries())


def test_bad_remote_url_is_a_usage_error(run):
    r = run("prepare", "--target", "h200", *QK, "--remote", "ftp://cache", code=2)
    assert "--remote: remote cache URL must be http(s)" in r.output


@pytest.mark.parametrize("label,msg", [
    ("qkv_front[fixed_m=0,n=100,num_kv_heads=1,splits=2,stages=4,tiles=1]", "not a q|k|v|gate layout"),
    ("qkv_front[fixed_m=5,n=2176,num_kv_heads=1,splits=16,stages=99,tiles=3]", "tiles must be 1 or 2"),
])
def test_impossible_variant_labels_are_usage_errors(run, label, msg):
    r = run("prepare", "--target", "h200", "--variant", label, code=2)
    assert msg in r.output


@needs_dsl
def test_doctor_counts_a_corrupt_entry_as_missing(run, tmp_path):
    run("prepare", "--target", "h200")
    from musekern.store.cache import Cache

    e = Cache(tmp_path / "cache").entries()[0]
    os.chmod(e.cubin_path, 0o644)
    e.cubin_path.write_bytes(b"\x7fELF-not-the-built-cubin")
    doc = json.loads(run("doctor", "--target", "h200", "--json", code=1).stdout)
    assert [m["variant"] for m in doc["missing"]] == [e.manifest["label"]]
