"""The musekern CLI core (plan, prepare, doctor) through click's CliRunner; exit codes 0/1/2 and --json."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from musekern import env
from musekern.cli import main
from musekern.cli.doctor_cmd import bindings_driver_problem
from musekern.store import hygiene, keys
from musekern.targets import get_target, target_from_device

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
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
    assert "qkv_front" in r.stdout and "2176" in r.stdout and "32 distinct variants" in r.stdout
    doc = json.loads(run("plan", "--target", "h200", "--json").stdout)
    tp8 = [row for row in doc["rows"] if row["tp"] == 8 and row["kernel"] == "qkv_front"]
    assert {(r["N"], r["k_split"], r["tiles"], r["fixed_rows"], r["tokens"]) for r in tp8} == {
        (2176, 2, 1, 0, "1-7"), (2176, 2, 1, 8, "8"), (2176, 2, 2, 0, "9-16"), (2176, 2, 3, 0, "17-24"),
        (2176, 2, 4, 0, "25-32"), (2176, 4, 6, 0, "33-48"), (2176, 4, 8, 0, "49-64")}


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
    monkeypatch.setattr("musekern.builder.compile.dsl_version", lambda: None)
    monkeypatch.setattr("musekern.builder.prepare.dsl_version", lambda: None)
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
    assert doc["nvidia-cutlass-dsl"] == keys.dsl_version() and len(doc["missing"]) == 32 and not doc["ok"]
    assert doc["cache_dir"] == str(tmp_path / "cache")
    from musekern.gemm.cublaslt import library_paths  # where the GEMM path's cuBLASLt would load from, or None

    assert doc["cublaslt"] == (library_paths()[0] if library_paths() else None)
    assert doc["gemm_tuning"] == {}  # no GPU has tuned into this cache
    r = run("doctor", "--target", "h200", code=1)
    assert "32 planned variant(s) missing from the cache" in r.stdout
    assert "cublaslt" in r.stdout and "none recorded" in r.stdout
    assert max(map(len, r.stdout.splitlines())) <= 120  # long labels wrapped (issue 28): --wide has one a line
    r = run("doctor", "--target", "h200", "--wide", code=1)
    assert all(m["variant"] in r.stdout for m in doc["missing"])  # every one, not "e.g." the first
    assert "fix: musekern prepare --target h200" in r.stderr  # fix commands go with the errors


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
    ("qkv_front[fixed_rows=0,k_split=2,n=100,num_kv_heads=1,stages=4,tiles=1]", "not a q|k|v|gate layout"),
    ("qkv_front[fixed_rows=5,k_split=16,n=2176,num_kv_heads=1,stages=99,tiles=9]", "tiles must be one of"),
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


# ---------------------------------------------------------------- --tp on every command that plans
def _planned_count(run, args):
    """How many variants a command planned, read from what each one reports."""
    cmd = args[0]
    if cmd == "plan":
        return len(json.loads(run(*args, "--json").stdout)["variants"])
    if cmd == "doctor":
        return len(json.loads(run(*args, "--json", code=1).stdout)["missing"])  # an empty cache misses all
    if cmd == "export":
        r = run(*args, "-o", "x.tar", code=1)
        return int(r.stderr.split(" of the ")[1].split()[0])  # "N of the M variants of the plan are not in"
    if cmd == "explain":
        return len(json.loads(run(*args, "--json").stdout)["planned"])


# --tp 8 plans TP 8's 7 variants (4 qk_norm + 3 qkv_front) where the bundled config plans 16; explain asks for
# one label (a TP 8 qkv_front one) and finds it planned once, or not at all under --tp 1.
TP8_LABEL = ("qkv_front[fixed_rows=8,k_split=2,n=2176,num_kv_heads=1,stages=6,tiles=1,trigger=late,"
             "trigger_ahead=6]")


@pytest.mark.parametrize("args,full,tp8", [
    (["plan", "--target", "h200"], 32, 14),  # test_variants.py::test_default_plan counts the 32; TP 8: 14 of them
    (["doctor", "--target", "h200"], 32, 14),
    (["export", "--target", "h200"], 32, 14),
    (["explain", TP8_LABEL, "--target", "h200"], 1, 1),
])
def test_tp_overrides_the_config_on_every_planning_command(run, args, full, tp8):
    assert _planned_count(run, args) == full
    assert _planned_count(run, [*args, "--tp", "8"]) == tp8
    if args[0] == "explain":
        assert "not in the plan" in run(*args, "--tp", "1", code=1).stderr  # TP 1 has no N=2176 front


def test_prepare_takes_tp(run, monkeypatch):
    monkeypatch.setattr("musekern.builder.prepare.dsl_version", lambda: None)  # stop before compiling anything
    monkeypatch.setattr("musekern.builder.compile.dsl_version", lambda: None)
    r = run("prepare", "--target", "h200", "--tp", "8", code=1)
    assert "musekern prepare: 14 variant(s) for h200" in r.stderr


def test_every_planning_command_has_tp():
    for name in ("plan", "prepare", "doctor", "export", "explain"):
        assert "--tp" in {o for p in main.commands[name].params for o in getattr(p, "opts", [])}, name


def test_config_without_tp_sizes_warns_on_stderr_and_in_json(run):
    cfg = os.path.join(DATA, "qwen3_style.json")
    r = run("plan", "--model", cfg, "--target", "h200", "--json")
    doc = json.loads(r.stdout)  # stdout is the JSON document alone
    assert doc["tp"] == [1] and doc["tp_source"] == "default" and len(doc["variants"]) == 10
    assert "names no tensor-parallel sizes" in doc["warnings"][0] and "--tp 1,2,4,8" in doc["warnings"][0]
    assert "musekern: warning:" in r.stderr and "names no tensor-parallel sizes" in r.stderr
    r = run("plan", "--model", cfg, "--target", "h200", "--tp", "1,2,4,8", "--json")
    doc = json.loads(r.stdout)
    assert doc["warnings"] == [] and len(doc["variants"]) == 32 and "warning" not in r.stderr
    doc = json.loads(run("doctor", "--model", cfg, "--target", "h200", "--json", code=1).stdout)
    assert doc["warnings"] and doc["tp_source"] == "default"


@pytest.mark.parametrize("tp,msg", [("3", "tp=3 does not divide num_attention_heads"), ("x", "comma-separated"),
                                    ("2,2", "duplicate"), ("", "comma-separated")])
def test_bad_tp_is_a_usage_error(run, tp, msg):
    assert msg in run("plan", "--target", "h200", "--tp", tp, code=2).output


# ---------------------------------------------------------------- targets: CLI > config > local GPU
A100 = target_from_device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 40 << 20)


def test_config_targets_win_over_a_local_gpu(run, monkeypatch):
    monkeypatch.setattr("musekern.cli.common.local_target", lambda: A100)
    assert json.loads(run("plan", "--json").stdout)["targets"] == ["h200"]  # the bundled config names h200
    monkeypatch.setattr("musekern.cli.common.local_target", lambda: get_target("h100-pcie"))
    assert json.loads(run("plan", "--json").stdout)["targets"] == ["h200"]
    assert json.loads(run("plan", "--target", "h20", "--json").stdout)["targets"] == ["h20"]  # the CLI wins


def test_local_gpu_is_the_last_resort(run, monkeypatch):
    monkeypatch.setattr("musekern.cli.common.local_target", lambda: get_target("h100-pcie"))
    cfg = os.path.join(DATA, "qwen3_style.json")  # names no targets
    assert json.loads(run("plan", "--model", cfg, "--json").stdout)["targets"] == ["h100-pcie"]


SUPPORTED = "supported targets: b200, h100, h100-pcie, h20, h200"


@pytest.mark.parametrize("args", [["plan", "--target", "a100"], ["prepare", "--target", "a100"],
                                  ["doctor", "--target", "A100"], ["export", "--target", "a100", "-o", "x.tar"]])
def test_an_unsupported_target_is_a_usage_error_naming_the_supported_ones(run, args):
    r = run(*args, code=2)
    assert "a100 (sm_80, 108 SMs) is not supported" in r.stderr and SUPPORTED in r.stderr


def test_an_unsupported_local_gpu_is_refused_not_planned(run, monkeypatch):
    monkeypatch.setattr("musekern.cli.common.local_target", lambda: A100)
    r = run("plan", "--model", os.path.join(DATA, "qwen3_style.json"), code=2)
    assert "the local GPU: a100 (sm_80, 108 SMs) is not supported" in r.stderr and SUPPORTED in r.stderr
    assert "--target" in r.stderr and "local-sm_80" not in r.output


# ---------------------------------------------------------------- errors are one line
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_prepare_into_an_impossible_cache_dir_is_one_line(run):
    r = run("prepare", "--target", "h200", *QK, "--cache-dir", "/proc/nope", code=1)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output
    assert r.stderr.startswith("musekern: error: cache /proc/nope") and "--cache-dir" in r.stderr


@pytest.mark.parametrize("args", [["doctor", "--target", "h200"], ["ls"], ["stats"], ["verify"]])
def test_an_unreadable_cache_is_one_line_naming_the_path(run, monkeypatch, tmp_path, args):
    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", "/srv/cache/v2")

    (tmp_path / "cache").mkdir()  # it exists (a missing one is its own error), but reading it is denied
    monkeypatch.setattr("musekern.store.cache.Cache.entries", denied)
    monkeypatch.setattr("musekern.store.cache.Cache.entry_keys", denied)
    r = run(*args, code=1)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("musekern: error: /srv/cache/v2: permission denied")
    assert "--cache-dir" in r.stderr


# ---------------------------------------------------------------- MUSEKERN_* variables
def test_help_lists_every_musekern_variable(run):
    out = run("--help").stdout
    assert all(v.name in out for v in env.VARIABLES) and len(env.VARIABLES) >= 5


def test_doctor_lists_every_variable_with_value_and_source(run, monkeypatch, tmp_path):
    monkeypatch.setenv("MUSEKERN_REMOTE", "http://cache.example:8080/mk")
    monkeypatch.delenv("MUSEKERN_AUTOBUILD", raising=False)
    doc = json.loads(run("doctor", "--target", "h200", "--json", code=1).stdout)
    got = {v["name"]: (v["value"], v["source"]) for v in doc["environment"]}
    assert set(got) == {v.name for v in env.VARIABLES}
    assert got["MUSEKERN_REMOTE"] == ("http://cache.example:8080/mk", "env")
    assert got["MUSEKERN_CACHE_DIR"] == (str(tmp_path / "cache"), "env") and got["MUSEKERN_AUTOBUILD"][1] == "default"
    out = run("doctor", "--target", "h200", code=1).stdout
    assert "http://cache.example:8080/mk (env)" in out and all(v.name in out for v in env.VARIABLES)


# Issue 28 finding 5 through the CLI: a --model that is a directory (click's multi-line usage error before), a FIFO
# (hung), /dev/zero (MemoryError), UTF-16 and deep nesting (tracebacks): exit 2 and one line naming the file.
@pytest.mark.parametrize("kind,reason", [("dir", "is a directory"), ("fifo", "is a FIFO"),
                                         ("zero", "is a character device"), ("utf16", "is UTF-16"),
                                         ("deep", "nests deeper than 32 levels")])
def test_a_hostile_model_file_exits_2_in_one_line(run, tmp_path, kind, reason):
    p = tmp_path / "m"
    if kind == "dir":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "zero":
        p = "/dev/zero"
    else:
        p.write_bytes('{"hidden_size": 8192}'.encode("utf-16") if kind == "utf16" else b"[" * 50000)
    r = run("plan", "--target", "h200", "--model", str(p), code=2)
    assert r.stderr.startswith(f"musekern: error: {p}: {reason}") and r.stderr.count("\n") == 1


def test_an_unread_head_key_is_warned_and_in_the_json(run, tmp_path):
    """Issue 28 finding 7: Falcon's num_kv_heads is read (TP 8: N = 2176, not 4096); a head-like key nothing reads
    is one warning line on stderr and in --json."""
    p = tmp_path / "falcon.json"
    p.write_text(json.dumps({"hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8,
                             "new_decoder_architecture": True, "attn_output_gate": True, "kv_lora_rank": 512}))
    r = run("plan", "--target", "h200", "--tp", "8", "--model", str(p), "--json")
    doc = json.loads(r.stdout)
    assert {row["N"] for row in doc["rows"]} == {2176}
    (w,) = [w for w in doc["warnings"] if "kv_lora_rank" in w]
    assert r.stderr.count("kv_lora_rank") == 1 and "does not read" in w


def test_doctor_never_shows_a_credential(run, monkeypatch):
    """Issue 28 finding 4: doctor (the README's image/CI check) printed MUSEKERN_REMOTE's password in text and
    --json. The password is masked, the token never shown, and both set at once is a problem doctor names."""
    monkeypatch.setenv("MUSEKERN_REMOTE", "http://ci:s3cret-pw@cache.example:8080/mk")
    monkeypatch.setenv("MUSEKERN_REMOTE_TOKEN", "s3cret-token")
    doc = json.loads(run("doctor", "--target", "h200", "--json", code=1).stdout)
    got = {v["name"]: v["value"] for v in doc["environment"]}
    assert got["MUSEKERN_REMOTE"] == "http://ci:***@cache.example:8080/mk"
    assert got["MUSEKERN_REMOTE_TOKEN"] == "(set, not shown)"
    assert any("both set" in p for p in doc["problems"])
    text = run("doctor", "--target", "h200", code=1)
    assert "http://ci:***@cache.example:8080/mk (env)" in text.stdout and "(set, not shown) (env)" in text.stdout
    for r in (text, run("doctor", "--target", "h200", "--json", code=1)):
        assert "s3cret" not in r.stdout + r.stderr


@pytest.mark.parametrize("remote", ["http://ci:s3cret/pw@cache/", "ci:s3cret@cache", "ftp://ci:s3cret@cache/"])
def test_a_bad_remote_url_is_one_line_without_its_password(run, remote):
    r = run("prepare", "--target", "h200", "--remote", remote, code=2)
    assert r.stderr.count("\n") == 1 and "ci:***@" in r.stderr and "s3cret" not in r.stdout + r.stderr


# cuda-bindings N.x needs a driver of CUDA N (cuDriverGetVersion: 1000 * major + 10 * minor).
@pytest.mark.parametrize("bindings,driver,problem", [
    ("13.4.4", 13000, None), ("13.0.0", 12080, "pip install 'cuda-bindings>=12.8,<13'"), ("12.9.0", 12040, None),
    ("12.8.0", 13000, None), ("12.9.0", 11080, "R525"), (None, 12080, None), ("13.1.0", None, None)])
def test_bindings_driver_problem(bindings, driver, problem):
    got = bindings_driver_problem(bindings, driver)
    assert (got is None) if problem is None else (problem in got)


# ---------------------------------------------------------------- stdout vs stderr (cli/__init__.py)
def test_json_stdout_is_one_document_and_logs_go_to_stderr(run, tmp_path):
    (tmp_path / "cache").mkdir()  # verify fails on a cache directory that does not exist
    for args in (["plan", "--target", "h200"], ["ls"], ["stats"], ["verify"]):
        json.loads(run(*args, "--json").stdout)
    r = run("plan", "--target", "h200")
    assert "32 distinct variants" in r.stdout.splitlines()[-1] and r.stderr == ""
    r = run("ls")
    assert r.stdout.splitlines()[-1].startswith("0 entries in ") and r.stderr == ""  # summary with the result


def test_clean_dry_run_never_says_removed(run, tmp_path, monkeypatch):
    from store_fakes import fake_parts, put

    from musekern.store.cache import Cache

    c = Cache(tmp_path / "cache")
    for i in range(2):
        put(c, fake_parts(i))
    hygiene.record_plan(c, "other", [])
    for args in (["clean", "--dry-run"], ["clean", "--stale", "--dry-run"], ["clean", "--all", "--dry-run"]):
        out = run(*args).stdout
        assert "removed" not in out.replace("would be removed", "").replace("would remove", ""), (args, out)
    assert len(c.entries()) == 2


# ---------------------------------------------------------------- export --shard K/N = what prepare --shard K/N built
@needs_dsl
@pytest.mark.slow
def test_export_shard_is_what_prepare_shard_built(run, tmp_path):
    built = {}
    for k in (1, 2):
        cd = str(tmp_path / f"shard{k}")
        doc = json.loads(run("prepare", "--target", "h200", "--tp", "8", "--shard", f"{k}/2", "--cache-dir", cd,
                             "--json").stdout)
        built[k] = sorted(r["key"] for r in doc["results"])
        out = tmp_path / f"shard{k}.tar"
        doc = json.loads(run("export", "--target", "h200", "--tp", "8", "--shard", f"{k}/2", "--cache-dir", cd,
                             "-o", str(out), "--json").stdout)
        assert sorted(doc["keys"]) == built[k] and doc["plan"].endswith(f"|shard {k}/2")
    assert len(built[1]) + len(built[2]) == 14 and not set(built[1]) & set(built[2])
    # the whole plan is not in one shard's cache: the fix names the shard's own prepare
    r = run("export", "--target", "h200", "--tp", "8", "--cache-dir", str(tmp_path / "shard1"), "-o", "all.tar",
            code=1)
    assert "--tp 8" in r.stderr and f"{len(built[2])} of the 14 variants of the plan" in r.stderr
    merged = str(tmp_path / "merged")
    for k in (1, 2):
        run("import", str(tmp_path / f"shard{k}.tar"), "--cache-dir", merged)
    # both shards' plans are recorded, so clean --stale keeps everything; the merged cache is complete
    assert json.loads(run("clean", "--stale", "--cache-dir", merged, "--json").stdout)["removed"] == []
    assert json.loads(run("doctor", "--target", "h200", "--tp", "8", "--cache-dir", merged, "--json").stdout)["ok"]


# TP 8 alone (14 builds per target) and the full plan (32) in 2 and 3 shards: a round robin over entries lined
# the two targets' builds up only when the builds per target were a multiple of the shard count.
@pytest.mark.parametrize("tp,builds_total", [((8,), 14), ((1, 2, 4, 8), 32)])
@pytest.mark.parametrize("n", [2, 3])
def test_shards_split_the_builds_not_just_the_entries(tp, builds_total, n):
    """h100 and h200 share every sm_90a build: sharding the README's two-target plan must split the compiles."""
    from musekern.config import load_config, with_tensor_parallel
    from musekern.plan import plan_model, shard_plan

    plan = plan_model(with_tensor_parallel(load_config(), tp), [get_target("h200"), get_target("h100")])
    shards = [shard_plan(plan, k, n) for k in range(1, n + 1)]
    builds = [{(e.arch, e.variant) for e in s} for s in shards]
    assert sum(map(len, builds)) == len(set().union(*builds)) == builds_total  # each build in one shard only
    assert max(map(len, builds)) - min(map(len, builds)) <= 1
    flat = [e for s in shards for e in s]
    assert len(flat) == len(set(flat)) and set(flat) == set(plan)  # and every entry in exactly one shard


# ---------------------------------------------------------------- issue 28, finding 9: CI logs
def test_prepare_without_a_terminal_prints_one_line_per_finished_variant(run, monkeypatch):
    """Before: one line at the start, then nothing until the end of a long build (click's bar draws nothing
    without a terminal)."""
    from store_fakes import fake_builds

    fake_builds(monkeypatch)
    r = run("prepare", "--target", "h200", *QK)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[")]
    labels = [QK[1], QK[3]]
    assert len(lines) == 2 and [ln.split()[0] for ln in lines] == ["[1/2]", "[2/2]"], r.stderr
    assert all(re.fullmatch(r"\[\d/2\] built \d+\.\ds (.*) \(h200\)", ln).group(1) in labels for ln in lines)
    r = run("prepare", "--target", "h200", *QK)
    assert [ln.split()[1] for ln in r.stderr.splitlines() if ln.startswith("[")] == ["hit", "hit"]


def test_progress_on_a_terminal_is_a_bar_not_lines():
    import io

    from musekern.cli.common import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with Progress(3, "prepare", lambda item: f"built {item}", file=out) as done:
        for item in ("a", "b", "c"):
            done(item)
    assert "[1/3]" not in out.getvalue() and "prepare" in out.getvalue()


# the widest table (plan: 218 columns before), ls's, and a table of one 300-character cell
@pytest.mark.parametrize("args", [("plan", "--target", "h200"), ("plan", "--target", "h200", "--tp", "1,2,4,8")])
def test_tables_fit_120_columns_unless_wide(run, args):
    narrow, wide = run(*args).stdout.splitlines(), run(*args, "--wide").stdout.splitlines()
    rows = len(json.loads(run(*args, "--json").stdout)["rows"])
    assert max(map(len, narrow)) <= 120 and len(narrow) > rows + 3  # wrapped rows: more lines than rows
    assert max(map(len, wide)) > 120 and len(wide) == rows + 3  # header, rule, rows, summary


@pytest.mark.parametrize("width", [40, 80, 120])
def test_a_wrapped_table_keeps_every_character_of_every_cell(width):
    from musekern.cli.common import table

    label = "qkv_front[" + ",".join(f"p{i}={'x' * (i % 7)}" for i in range(40)) + "]"
    rows = [["h200", 1, label], ["h100", 22, "short"], ["b200", 3, "y" * 300]]
    lines = table(rows, ["target", "tp", "label"], width=width).splitlines()
    assert max(map(len, lines)) <= width
    start = lines[0].index("label")
    col = [ln[start:] for ln in lines[2:]]
    firsts = [i for i, ln in enumerate(lines[2:]) if ln[:start].strip()]
    cells = ["".join(col[a:b]) for a, b in zip(firsts, [*firsts[1:], len(col)], strict=True)]
    assert cells == [label, "short", "y" * 300]


# --kv-cache-dtype on the planning commands (vLLM's values): the FP8 builds replace the bf16 ones, the config's
# musekern.kv_cache_dtype is read, the flag overrides it, e5m2 is refused in one line
def test_plan_kv_cache_dtype(run, tmp_path):
    doc = json.loads(run("plan", "--target", "h200", "--kv-cache-dtype", "fp8", "--json").stdout)
    assert doc["kv_cache_dtype"] == "fp8_e4m3"
    kinds = {r["kernel"]: r.get("kv_cache_dtype") for r in doc["rows"]}
    assert kinds == {"qk_norm": None, "qkv_front": "fp8_e4m3", "qkv_epilogue": "fp8_e4m3"}
    bf16 = json.loads(run("plan", "--target", "h200", "--kv-cache-dtype", "auto", "--json").stdout)
    assert bf16 == json.loads(run("plan", "--target", "h200", "--json").stdout)  # auto: today's plan, unchanged
    cfg = json.load(open(os.path.join(os.path.dirname(DATA), "..", "musekern", "data", "muse_spark.json")))
    cfg["musekern"]["kv_cache_dtype"] = "fp8_e4m3"
    p = tmp_path / "fp8.json"
    p.write_text(json.dumps(cfg))
    from_cfg = json.loads(run("plan", "--model", str(p), "--json").stdout)
    assert from_cfg["rows"] == doc["rows"]
    back = json.loads(run("plan", "--model", str(p), "--kv-cache-dtype", "bf16", "--json").stdout)
    assert back["rows"] == bf16["rows"]


# an FP8 checkpoint (DeepSeek-style quantization_config) plans the FP8-weight front builds (block scales) in the bf16
# ones' place, M <= 16 each, 32 at TP8 (the GEMM path above, with its x quantization's build); the epilogue's and
# qk_norm's builds are the same; nothing warns; --weight-format overrides the config either way
def test_plan_fp8_weights_config(run, tmp_path):
    cfg = json.load(open(os.path.join(os.path.dirname(DATA), "..", "musekern", "data", "muse_spark.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    p = tmp_path / "fp8w.json"
    p.write_text(json.dumps(cfg))
    r = run("plan", "--model", str(p), "--target", "h200", "--json")
    doc = json.loads(r.stdout)
    assert doc["weight_format"] == "fp8-block" and not any("FP8" in w for w in doc["warnings"])
    assert "FP8" not in r.stderr
    bf16 = json.loads(run("plan", "--target", "h200", "--json").stdout)
    assert bf16["weight_format"] == "bf16"
    front = [row for row in doc["rows"] if row["kernel"] == "qkv_front"]
    assert front and {(row["weight_dtype"], row["weight_scale"]) for row in front} == {("fp8_e4m3", "block")}
    # (TP8: 1-8 and 9-16 its W8A8 builds, 17-32 its 4-tile build)
    assert {row["tokens"] for row in front} <= {"1-7", "1-8", "8", "9-16", "17-32"}
    assert {(row["weight_dtype"], row["weight_scale"]) for row in bf16["rows"]
            if row["kernel"] == "qkv_front"} == {("bf16", "none")}
    others = [row for row in doc["rows"] if row["kernel"] not in ("qkv_front", "x_quant")]
    assert others == [row for row in bf16["rows"] if row["kernel"] != "qkv_front"]
    assert {row["label"] for row in doc["rows"] if row["kernel"] == "x_quant"} == {"x_quant[group=128]"}
    back = json.loads(run("plan", "--model", str(p), "--target", "h200", "--weight-format", "bf16", "--json").stdout)
    assert back["rows"] == bf16["rows"] and back["warnings"] == bf16["warnings"]


# --weight-format on the commands that take --kv-cache-dtype: each override plans its builds (per-tensor checkpoints
# pack to per-row scales: the channel builds), no warning (every GEMM path is W8A8)
@pytest.mark.parametrize("value,scale", [("fp8-channel", "channel"), ("fp8-tensor", "channel"),
                                         ("fp8-block", "block"), ("fp8-block-ue8m0", "block")])
def test_plan_weight_format_override(run, value, scale):
    r = run("plan", "--target", "h200", "--weight-format", value, "--json")
    doc = json.loads(r.stdout)
    assert doc["weight_format"] == value
    front = {(row["weight_dtype"], row["weight_scale"]) for row in doc["rows"] if row["kernel"] == "qkv_front"}
    assert front == {("fp8_e4m3", scale)}
    assert not any("FP8" in w for w in doc["warnings"])
    text = run("plan", "--target", "h200", "--weight-format", value).stdout
    assert f"(weights {value})" in text.splitlines()[-1]


@pytest.mark.parametrize("cmd", ["plan", "prepare", "doctor", "explain", "export"])
def test_weight_format_unknown_is_refused(run, cmd):
    extra = {"explain": ["qk_norm[dtype=bfloat16,has_scale=False,head_dim=64]"], "export": ["-o", "x.tar"]}
    r = run(cmd, *extra.get(cmd, []), "--target", "h200", "--weight-format", "int4", code=2)
    assert "unknown weight format 'int4'; choose one of auto, bf16, fp8-block" in r.output


def test_doctor_fix_command_names_the_weight_format():
    from musekern.cli.common import PlanOptions
    from musekern.cli.doctor_cmd import _fix_command

    cmd = _fix_command(PlanOptions(kv_cache_dtype="fp8_e4m3", weight_format="fp8-channel"), None, [{"target": "h200"}])
    assert cmd == "musekern prepare --target h200 --kv-cache-dtype fp8_e4m3 --weight-format fp8-channel"
    assert "--weight-format" not in _fix_command(PlanOptions(), None, [{"target": "h200"}])
    cmd = _fix_command(PlanOptions(model_path="my model.json", tp=(8,)), "/c d", [{"target": "h200"}])
    assert cmd == "musekern prepare --model 'my model.json' --target h200 --tp 8 --cache-dir '/c d'"  # shell-quoted


# Every fix a planning command suggests names the options that chose the plan (explain's and export's named only
# --model and --tp: their `prepare` built the bf16 plan of an FP8 one, and the command still failed after it).
@pytest.mark.parametrize("opts", [["--weight-format", "fp8-block"], ["--tp", "8", "--kv-cache-dtype", "fp8_e4m3"]],
                         ids=["weight-format", "kv-tp"])
def test_fix_commands_name_the_plan_options(run, opts):
    r = run("export", "--target", "h200", *opts, "-o", "x.tar", code=1)
    fix = re.search(r"run `(musekern prepare[^`]*)` first", r.stderr).group(1)
    assert fix == f"musekern prepare --target h200 {' '.join(opts)} --cache-dir {os.environ['MUSEKERN_CACHE_DIR']}"
    label = json.loads(run("plan", "--target", "h200", *opts, "--json").stdout)["rows"][0]["label"]
    r = run("explain", label, "--target", "h200", *opts)
    assert f"fix: musekern prepare --target h200 {' '.join(opts)}" in r.stderr
    r = run("doctor", "--target", "h200", *opts, code=1)
    assert f"fix: musekern prepare --target h200 {' '.join(opts)}" in r.stderr


@pytest.mark.parametrize("cmd", ["plan", "prepare", "doctor", "explain", "export"])
def test_kv_cache_dtype_e5m2_is_refused(run, cmd):
    extra = {"explain": ["qk_norm[dtype=bfloat16,has_scale=False,head_dim=64]"], "export": ["-o", "x.tar"]}
    r = run(cmd, *extra.get(cmd, []), "--target", "h200", "--kv-cache-dtype", "fp8_e5m2", code=2)
    assert "fp8_e5m2 KV caches are not served" in r.output


# Two plans of one config (another --tp, --kv-cache-dtype or --weight-format) in one cache: each keeps its own
# record, so `clean --stale` removes neither's entries (one shared record name kept only the last prepare's plan).
@pytest.mark.parametrize("first,second", [(["--tp", "8"], ["--tp", "1"]),
                                          ([], ["--weight-format", "fp8-block"]),
                                          ([], ["--kv-cache-dtype", "fp8"])], ids=["tp", "weight-format", "kv"])
def test_plans_of_one_config_keep_their_own_records(run, monkeypatch, first, second):
    from store_fakes import fake_builds

    fake_builds(monkeypatch)
    keys_of = {}
    for opts in (first, second):
        doc = json.loads(run("prepare", "--target", "h200", *opts, "--json").stdout)
        keys_of[tuple(opts)] = {r["key"] for r in doc["results"]}
    assert keys_of[tuple(first)] - keys_of[tuple(second)]  # the first plan has builds the second lacks
    doc = json.loads(run("clean", "--stale", "--dry-run", "--json").stdout)
    assert doc["removed"] == [], doc
    for opts in (first, second):  # and each plan is still whole
        assert json.loads(run("doctor", "--target", "h200", *opts, "--json").stdout)["missing"] == []
