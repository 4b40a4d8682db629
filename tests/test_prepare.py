"""prepare (musekern/prepare.py through the CLI): hits are verified, corrupt entries rebuilt, read-only
caches refused in one line, shards, and a real remote HTTP cache (nginx) for pull/upload/degrade."""
import importlib.util
import json
import os
import shutil
import stat

import pytest
from click.testing import CliRunner
from store_fakes import fake_builds

from musekern.cli import main
from musekern.store import hygiene
from musekern.store.cache import Cache

pytestmark = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                reason="needs the build extra (nvidia-cutlass-dsl)")
LABELS = ["--variant", "qk_norm[dtype=bfloat16,has_scale=False,head_dim=64]",
          "--variant", "qk_norm[dtype=float16,has_scale=True,head_dim=128]"]


def prepare(cache_dir, *args, code=0):
    r = CliRunner().invoke(main, ["prepare", "--target", "h200", "--cache-dir", str(cache_dir), "--json", *args])
    assert r.exit_code == code, r.output
    return json.loads(r.stdout) if code == 0 else r


def test_corrupt_entry_is_rebuilt_not_counted_as_hit(tmp_path):
    doc = prepare(tmp_path / "c", *LABELS)
    assert doc["counts"]["built"] == 2
    cache = Cache(tmp_path / "c")
    e = cache.entries()[0]
    os.chmod(e.cubin_path, stat.S_IRUSR | stat.S_IWUSR)
    e.cubin_path.write_bytes(e.cubin_path.read_bytes()[:-7])  # truncated
    doc = prepare(tmp_path / "c", *LABELS)
    assert doc["counts"] == {"built": 1, "hit": 1, "pulled": 0, "failed": 0}
    assert all(cache.verify_entry(x) == [] for x in cache.entries())


def test_prepare_indexes_entries_of_a_cache_from_before_the_index(tmp_path):
    """A cache without index markers (written before they existed) gets one per present entry."""
    prepare(tmp_path / "c", *LABELS)
    cache = Cache(tmp_path / "c")
    marks = lambda: sorted(k for d in cache.index_dir.iterdir() for k in os.listdir(d))  # noqa: E731
    before = marks()
    assert len(before) == 2
    for d in cache.index_dir.iterdir():
        for k in os.listdir(d):
            os.unlink(d / k)
    assert marks() == []
    assert prepare(tmp_path / "c", *LABELS)["counts"]["hit"] == 2
    assert marks() == before


def test_read_only_cache_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(Cache, "read_only", property(lambda self: True))
    r = prepare(tmp_path / "ro", *LABELS, code=1)
    err = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(err) == 1 and "read-only" in err[0] and "--cache-dir" in err[0]


def test_read_only_cache_with_everything_present_is_fine(tmp_path, monkeypatch):
    prepare(tmp_path / "c", *LABELS)
    monkeypatch.setattr(Cache, "read_only", property(lambda self: True))
    assert prepare(tmp_path / "c", *LABELS)["counts"]["hit"] == 2


def test_shards_build_the_whole_plan_once(tmp_path):
    keys = []
    for k in (1, 2, 3):
        doc = prepare(tmp_path / "c", "--shard", f"{k}/3")
        keys += [r["key"] for r in doc["results"]]
    full = prepare(tmp_path / "c")
    assert sorted(keys) == sorted(r["key"] for r in full["results"]) and len(set(keys)) == len(keys)
    assert full["counts"]["hit"] == len(keys)  # nothing left to build
    assert hygiene.plans(Cache(tmp_path / "c")), "the full plan is recorded (for clean --stale)"


def test_warm_remote_means_zero_compiles(tmp_path, nginx_server):
    url, _ = nginx_server
    a = prepare(tmp_path / "a", *LABELS, "--remote", url, "--upload")
    assert a["counts"]["built"] == 2 and all(r["uploaded"] for r in a["results"])
    b = prepare(tmp_path / "b", *LABELS, "--remote", url)
    assert b["counts"] == {"built": 0, "hit": 0, "pulled": 2, "failed": 0}
    cb = Cache(tmp_path / "b")
    assert all(cb.verify_entry(e) == [] for e in cb.entries())


def test_corrupt_remote_blob_is_rejected_and_rebuilt(tmp_path, nginx_server):
    url, root = nginx_server
    prepare(tmp_path / "a", *LABELS, "--remote", url, "--upload")
    for blob in (root / "cas").iterdir():
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
    b = prepare(tmp_path / "b", *LABELS, "--remote", url)
    assert b["counts"]["built"] == 2 and b["counts"]["pulled"] == 0
    assert b["warnings"], "the rejected blobs are reported"


def test_dead_remote_degrades_to_local_build(tmp_path, no_proxy):
    from conftest import free_port

    doc = prepare(tmp_path / "c", *LABELS, "--remote", f"http://127.0.0.1:{free_port()}")
    assert doc["counts"]["built"] == 2 and doc["ok"]
    assert any("127.0.0.1" in w for w in doc["warnings"])


def test_two_cold_prepares_give_identical_cubins(tmp_path):
    """Compiles are reproducible: same keys, same cubin hashes, from two empty caches (also qkv_front)."""
    labels = [*LABELS, "--variant", "qkv_front[fixed_rows=0,k_split=2,n=2176,num_kv_heads=1,stages=8,tiles=2]"]
    a, b = prepare(tmp_path / "a", *labels), prepare(tmp_path / "b", *labels)
    assert [r["key"] for r in a["results"]] == [r["key"] for r in b["results"]]
    sha = lambda d: {e.key: e.manifest["cubin_sha256"] for e in Cache(d).entries()}  # noqa: E731
    assert sha(tmp_path / "a") == sha(tmp_path / "b") and len(sha(tmp_path / "a")) == 3


def test_without_the_dsl_a_corrupt_entry_is_missing_not_a_hit(tmp_path, monkeypatch):
    """No build extra: entries of any DSL version serve, but only if they verify."""
    prepare(tmp_path / "c", *LABELS)
    monkeypatch.setattr("musekern.builder.prepare.dsl_version", lambda: None)
    assert prepare(tmp_path / "c", *LABELS)["counts"]["hit"] == 2
    e = Cache(tmp_path / "c").entries()[0]
    os.chmod(e.cubin_path, stat.S_IRUSR | stat.S_IWUSR)
    e.cubin_path.write_bytes(e.cubin_path.read_bytes()[:-3])
    r = prepare(tmp_path / "c", *LABELS, code=1)
    assert "musekern[build]" in r.output


# ---------------------------------------------------------------- issue 12: the whole plan onto a full disk


def _plan():
    from musekern.config import load_config
    from musekern.plan import plan_model
    from musekern.targets import get_target

    return plan_model(load_config(None), [get_target("h200")])


@pytest.mark.parametrize("room", [0, 2000, 20_000, 60_000])
def test_prepare_onto_a_full_disk_fails_per_variant_and_tears_nothing(tmp_path, monkeypatch, room):
    """The whole plan with `room` bytes left: per-variant errors naming the path and the fix, never an
    exception out of prepare (before: the plan record's write raised out of prepare; a staging write's error was
    `OSError: [Errno 28] No space left on device`, naming no path), and no torn entry."""
    from store_fakes import fail_writes_under

    prepare_mod = fake_builds(monkeypatch)
    cache = Cache(tmp_path / "c")
    fail_writes_under(monkeypatch, cache.root, room)
    report = prepare_mod.prepare(_plan(), cache, plan_name="cfg|h200")
    failed = [r for r in report.results if r.status == prepare_mod.FAILED]
    assert failed and all("no space left" in r.error.lower() and str(cache.root) in r.error and "\n" not in r.error
                          for r in failed), [r.error for r in failed]
    monkeypatch.undo()
    assert cache.audit() == {} and not list(cache.tmp_dir.iterdir())


def test_prepare_counts_lookups_and_trims_to_the_size_policy_keeping_its_plan(tmp_path, monkeypatch):
    """ccache-style: after a run the cache is trimmed to its lasting size policy, least recently used first,
    never removing what this plan needs; each planned variant counts one hit or miss, each build one built."""
    from store_fakes import fake_cubin, fake_manifest, fake_parts

    prepare_mod = fake_builds(monkeypatch)
    monkeypatch.delenv("MUSEKERN_MAX_SIZE", raising=False)
    cache = Cache(tmp_path / "c")
    old = [fake_parts(i) for i in range(3)]
    for p in old:
        cache.put(p, fake_cubin(p), fake_manifest(p))
    plan = _plan()
    hygiene.set_max_size(cache, 1)  # smaller than the plan itself: only the old entries can go
    report = prepare_mod.prepare(plan, cache, plan_name="cfg|h200")
    assert report.ok and sorted(report.trimmed) == sorted(p.key() for p in old)
    assert len(cache.entries()) == len(plan) and not any(cache.get(p.key()) for p in old)
    assert hygiene.counters(cache) == {"hit": 0, "miss": len(plan), "built": len(plan), "pulled": 0}
    again = prepare_mod.prepare(plan, cache, plan_name="cfg|h200")
    assert again.count(prepare_mod.HIT) == len(plan) and again.trimmed == []
    assert hygiene.counters(cache)["hit"] == len(plan)


def test_prepare_into_a_cache_under_proc_is_one_cache_error(tmp_path, monkeypatch):
    """`prepare --cache-dir /proc/nope`: one CacheError naming the path (the CLI prints it; before, a chained
    FileNotFoundError traceback)."""
    from musekern.store.cache import CacheError

    prepare_mod = fake_builds(monkeypatch)
    with pytest.raises(CacheError) as ei:
        prepare_mod.prepare(_plan()[:1], Cache("/proc/nope"))
    assert "/proc/nope" in str(ei.value) and "\n" not in str(ei.value) and "--cache-dir" in str(ei.value)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root and mount(8) for a tmpfs")
# free space from one page (not even the plan record fits) to room for all of it (the plan's fake entries take
# two pages each on a tmpfs, the lock files, stamps and index markers a page more per variant)
@pytest.mark.parametrize("room_kib", [4, 8, 16, 32, 64, 128, 1024])
def test_prepare_and_import_onto_a_real_full_tmpfs(tmp_path, monkeypatch, room_kib):
    """The review's free-space levels on a real filesystem (a tmpfs of `room_kib`): whole-plan prepare and
    import end without a traceback, every failure is one line, nothing is torn, no staging dir is left."""
    import subprocess

    prepare_mod = fake_builds(monkeypatch)
    src = Cache(tmp_path / "src")
    plan = _plan()
    assert prepare_mod.prepare(plan, src).ok
    bundle = tmp_path / "b.tar"
    from musekern.store.bundle import export_bundle, import_bundle

    export_bundle(src, [e.key for e in src.entries()], bundle)
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room_kib}k", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        for run in ("prepare", "import"):
            cache = Cache(mnt / run)
            if run == "prepare":
                report = prepare_mod.prepare(plan, cache, plan_name="cfg|h200")
                errors = [x.error for x in report.results if x.status == prepare_mod.FAILED]
            else:
                rep = import_bundle(cache, bundle)
                errors = [reason for _, reason in rep.failed]
                assert not rep.rejected
            assert all("\n" not in err and str(cache.root) in err for err in errors), errors
            assert cache.audit() == {}
            assert not cache.tmp_dir.exists() or list(cache.tmp_dir.iterdir()) == []
            if room_kib in (4, 1024):  # the ends of the grid: full at once, and room for everything
                assert bool(errors) == (room_kib == 4), (run, room_kib, errors)
            subprocess.run(["rm", "-rf", str(cache.root)], check=True)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_signed_ci_warming_and_trusting_consumers(tmp_path, nginx_server, monkeypatch):
    """The keys flow with real builds: CI prepares with --sign-key and --upload (its own entries signed too); a
    consumer trusting that key pulls everything, one trusting another key pulls nothing and builds (warned)."""
    from musekern.store import signing

    url, _ = nginx_server
    keys = {}
    for name in ("ci-1", "ci-2"):
        k = signing.generate(name)
        signing.write_secret(k, tmp_path / f"{name}.sec")
        keys[name] = k.public_text
    monkeypatch.setenv("MUSEKERN_SIGN_KEY", str(tmp_path / "ci-1.sec"))
    a = prepare(tmp_path / "a", *LABELS, "--remote", url, "--upload")
    assert a["counts"]["built"] == 2 and all(r["uploaded"] for r in a["results"])
    assert all(signing.signers(e.manifest) == ["ci-1"] for e in Cache(tmp_path / "a").entries())
    monkeypatch.delenv("MUSEKERN_SIGN_KEY")
    b = prepare(tmp_path / "b", *LABELS, "--remote", url, "--trusted-keys", keys["ci-1"])
    assert b["counts"]["pulled"] == 2
    monkeypatch.setenv("MUSEKERN_TRUSTED_KEYS", keys["ci-2"])
    c = prepare(tmp_path / "c", *LABELS, "--remote", url)
    assert c["counts"]["pulled"] == 0 and c["counts"]["built"] == 2
    assert len(c["warnings"]) == 2 and all("signed only by untrusted key ci-1" in w for w in c["warnings"])


# every directory the store makes, planted as a link to an outside directory of sentinels: prepare (its builds,
# plan record, stamps, counters, index markers and its size policy's evictions) writes and deletes nothing there,
# and says why. Before the fix, with MUSEKERN_MAX_SIZE=1: 4 sentinels deleted through used/, 13 files created
# through v2/, 3 through entries/, 2 through index/, 1 through locks/, 2 counters appended to through stats/.
@pytest.mark.parametrize("rel", __import__("store_fakes").OWN_DIRS)
def test_prepare_never_writes_or_deletes_through_a_planted_link(tmp_path, monkeypatch, rel):
    from store_fakes import lived_in, plant_outside, tree

    fake_builds(monkeypatch)
    monkeypatch.setenv("MUSEKERN_MAX_SIZE", "1")
    cache, keys = lived_in(tmp_path / "c")
    planted = plant_outside(cache, rel, tmp_path / "outside", keys)
    before = tree(tmp_path / "outside")
    r = CliRunner().invoke(main, ["prepare", "--target", "h200", "--cache-dir", str(cache.root), *LABELS[:2]])
    assert tree(tmp_path / "outside") == before
    assert r.exit_code in (0, 1) and f"{planted} is a symbolic link" in r.stderr, r.stderr
    assert "Traceback" not in r.output


def test_a_size_policy_below_the_plan_says_what_it_evicted_and_that_it_cannot_be_met(tmp_path, monkeypatch):
    """MUSEKERN_MAX_SIZE=100K, smaller than the plan: before, prepare evicted another plan's entries and printed only
    "nothing to do", the cache left over the limit unsaid. Now: one line for what was evicted (and that another
    recorded plan needed it), one that the limit cannot be met, the plan's own entries all kept."""
    from store_fakes import fake_parts, put

    fake_builds(monkeypatch)
    cache = Cache(tmp_path / "c")
    other = [fake_parts(i) for i in range(3)]
    for p in other:
        put(cache, p)
    hygiene.record_plan(cache, "other|h200", [p.key() for p in other])
    run = lambda: CliRunner().invoke(main, ["prepare", "--target", "h200", "--cache-dir", str(cache.root)])  # noqa
    assert run().exit_code == 0  # the whole bundled plan, built (fake)
    planned = {e.key for e in cache.entries()} - {p.key() for p in other}
    monkeypatch.setenv("MUSEKERN_MAX_SIZE", "100K")
    r = run()
    assert r.exit_code == 0 and "nothing to build; 3 other entries evicted by the size policy" in r.stdout, r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "size policy" in ln]
    assert len(lines) == 2 and all(ln.startswith("musekern: warning: ") for ln in lines), r.stderr
    assert "evicted 3 least recently used entries" in lines[0] and "3 of them needed by another recorded plan" \
        in lines[0] and "MUSEKERN_MAX_SIZE" in lines[0]
    assert "over its size policy at most 97.7 KiB" in lines[1] and "raise the limit" in lines[1]
    assert {e.key for e in cache.entries()} == planned
    r = run()  # nothing left to evict: only that the limit cannot be met
    assert [ln for ln in r.stderr.splitlines() if "size policy" in ln] == lines[1:] and "nothing to do" in r.stdout


def test_the_size_policy_never_evicts_what_prepare_served_from_without_the_dsl(tmp_path, monkeypatch):
    """No DSL installed: another DSL version's builds serve the plan; they are what this prepare needs, so the size
    policy keeps them (before: the plan's exact keys were kept, and the entries actually serving it evicted)."""
    prepare_mod = fake_builds(monkeypatch)
    cache = Cache(tmp_path / "c")
    plan = _plan()
    assert prepare_mod.prepare(plan, cache).ok
    hygiene.set_max_size(cache, 1)
    monkeypatch.setattr(prepare_mod, "dsl_version", lambda: None)
    report = prepare_mod.prepare(plan, cache)
    assert report.count(prepare_mod.HIT) == len(plan) and report.trimmed == []
    assert len(cache.entries()) == len(plan)
