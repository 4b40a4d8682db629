"""store/tuning.py: the GEMM tuning records round-trip and merge; concurrent writers lose nothing; hostile files
(truncated, huge, nested, symlinked, a FIFO, wrong types and ranges, another scope's) read as empty or lose only
their bad shapes, never raise or hang; a read-only, missing or full cache keeps no record and says why in one line;
`clean --all` removes the records and `stats` counts them."""
import errno
import json
import os

import pytest

from musekern.store import tuning
from musekern.store.cache import Cache

SCOPE = tuning.scope("NVIDIA H200", (9, 0), 132, 130100)
ALGO = bytes(range(64))
LT = tuning.Record("lt[tile=317,splitk=1,ws=0]", ALGO, 0, {"mm": 26.9, "lt[tile=317,splitk=1,ws=0]": 22.2})
MM = tuning.Record("mm", None, 0, {"mm": 15.1, "lt[tile=317,splitk=3,ws=1697296]": 15.0})


@pytest.fixture
def cache(tmp_path) -> Cache:
    c = Cache(tmp_path / "cache")
    c.base.mkdir(parents=True)  # a cache the kernels were loaded from
    return c


def _write(cache, doc) -> None:
    tuning.tuning_dir(cache).mkdir(parents=True, exist_ok=True)
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    tuning.path_of(cache, SCOPE).write_bytes(raw)


def test_scope_names_the_gpu_and_library_safely():
    assert SCOPE == "NVIDIA-H200.sm90.132sms.cublaslt130100"
    assert tuning.scope("../../etc/x y", (9, 0), 1, 2) == "etc-x-y.sm90.1sms.cublaslt2"
    for bad in ("../x", "a/b", "", "x" * 161):
        with pytest.raises(ValueError):
            tuning.path_of(Cache("/tmp/c"), bad)


def test_records_round_trip_and_merge(cache):
    assert tuning.load(cache, SCOPE) == {}
    assert tuning.save(cache, SCOPE, {(4352, 65): LT}) is None
    assert tuning.save(cache, SCOPE, {(2176, 65): MM}) is None  # another shape: merged
    got = tuning.load(cache, SCOPE)
    assert got == {(4352, 65): LT, (2176, 65): MM}
    newer = tuning.Record("mm", None, 0, {"mm": 20.0})
    assert tuning.save(cache, SCOPE, {(4352, 65): newer}) is None  # the same shape: the newer measurement wins
    assert tuning.load(cache, SCOPE) == {(4352, 65): newer, (2176, 65): MM}
    assert tuning.load(cache, tuning.scope("NVIDIA H100", (9, 0), 132, 130100)) == {}  # another GPU: nothing
    assert tuning.summary(cache) == {SCOPE: 2}


def test_concurrent_writers_lose_no_shape(cache):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")

    def write(k):
        c = Cache(cache.root)
        for m in range(40):
            assert tuning.save(c, SCOPE, {(1000 + k, m + 1): MM}) is None
        os._exit(0)

    procs = [ctx.Process(target=write, args=(k,)) for k in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(tuning.load(cache, SCOPE)) == 6 * 40  # every writer merged under the lock


def test_a_killed_writer_leaves_the_record_whole(cache):
    tuning.save(cache, SCOPE, {(4352, 65): LT})
    # what a writer killed between its temp file and the rename leaves: the temp file, the old record untouched
    (tuning.tuning_dir(cache) / f".{SCOPE}.json.999.deadbeef.tmp").write_bytes(b'{"format": 1, "sco')
    assert tuning.load(cache, SCOPE) == {(4352, 65): LT} and tuning.summary(cache) == {SCOPE: 1}
    assert tuning.clear(cache) == [SCOPE] and os.listdir(tuning.tuning_dir(cache)) == []  # clean takes the debris


def _good():
    return {"format": 1, "scope": SCOPE, "shapes": {"4352x65": {"chosen": LT.chosen, "algo": ALGO.hex(),
                                                                "workspace": 0, "us": LT.us}}}


# whole files that are not ours: each reads as no record at all
@pytest.mark.parametrize("doc", [
    b"", b"{", b"\xff\xfe", b"[]", b"null", b"[" * 10000 + b"]" * 10000,
    {"format": 2, "scope": SCOPE, "shapes": {}},                  # another format
    {"format": 1, "scope": "NVIDIA-H100.sm90.132sms.cublaslt130100", "shapes": _good()["shapes"]},  # another scope's
    {"format": 1, "scope": SCOPE, "shapes": []},
    {"format": True, "scope": SCOPE, "shapes": _good()["shapes"]},
    b'{"format": 1, "scope": "%s", "shapes": {"4352x65": {"chosen": "mm", "us": {"mm": NaN}}}}' % SCOPE.encode(),
])
def test_a_file_not_ours_reads_as_empty(cache, doc):
    _write(cache, doc)
    assert tuning.load(cache, SCOPE) == {}


def test_a_file_too_large_a_symlink_or_a_fifo_reads_as_empty(cache, tmp_path):
    _write(cache, b" " * (tuning.MAX_BYTES + 1))
    assert tuning.load(cache, SCOPE) == {}
    path = tuning.path_of(cache, SCOPE)
    path.unlink()
    good = tmp_path / "elsewhere.json"
    good.write_text(json.dumps(_good()))
    os.symlink(good, path)
    assert tuning.load(cache, SCOPE) == {}  # never followed
    path.unlink()
    os.mkfifo(path)
    assert tuning.load(cache, SCOPE) == {}  # no writer on the FIFO: returns at once


# one bad shape among good ones: only it is left out (the grid: every field's type, range and spelling)
@pytest.mark.parametrize("key, value", [
    ("0x65", None), ("4352x0", None), ("4352x", None), (" 4352x65", None), ("4352x65x1", None), ("-1x65", None),
    ("4352x999999999", None),
    ("4352x66", {"chosen": "mm", "us": {}}),                                   # no times
    ("4352x66", {"chosen": "lt[a]", "us": {"mm": 1.0}}),                       # chosen not among the times
    ("4352x66", {"chosen": "mm", "us": {"mm": -1.0}}),                         # a negative time
    ("4352x66", {"chosen": "mm", "us": {"mm": "1"}}),                          # a string
    ("4352x66", {"chosen": "mm", "us": {"mm": True}}),                         # a bool
    ("4352x66", {"chosen": "mm", "us": {"mm": 1.0}, "algo": ALGO.hex()}),      # torch.mm with an algorithm
    ("4352x66", {"chosen": "mm", "us": {"mm": 1.0}, "extra": 1}),              # a field not ours
    ("4352x66", {"chosen": "lt[a]", "us": {"lt[a]": 1.0}}),                    # an algorithm without its bytes
    ("4352x66", {"chosen": "lt[a]", "us": {"lt[a]": 1.0}, "algo": ALGO.hex()[:-2]}),   # 63 bytes
    ("4352x66", {"chosen": "lt[a]", "us": {"lt[a]": 1.0}, "algo": ALGO.hex().upper()}),
    ("4352x66", {"chosen": "lt[a]", "us": {"lt[a]": 1.0}, "algo": "zz" * 64}),
    ("4352x66", {"chosen": "lt[a]", "us": {"lt[a]": 1.0}, "algo": ALGO.hex(), "workspace": -1}),
    ("4352x66", {"chosen": "lt[a]", "us": {"lt[a]": 1.0}, "algo": ALGO.hex(), "workspace": 1 << 40}),
    ("4352x66", {"chosen": "lt[a]", "us": {"lt[a]": 1.0}, "algo": ALGO.hex(), "workspace": True}),
    ("4352x66", {"chosen": "lt[a]/../x", "us": {"lt[a]/../x": 1.0}, "algo": ALGO.hex()}),
    ("4352x66", {"chosen": "mm\n", "us": {"mm\n": 1.0}}),                        # a name with a newline
    ("4352x66", {"chosen": "mm", "us": {f"c{i}": 1.0 for i in range(65)} | {"mm": 1.0}}),  # too many candidates
    ("4352x66", ["mm"]),
])
def test_a_bad_shape_is_left_out(cache, key, value):
    doc = _good()
    doc["shapes"][key] = value
    _write(cache, doc)
    assert tuning.load(cache, SCOPE) == {(4352, 65): LT}


def test_a_read_only_missing_or_full_cache_keeps_no_record(cache, tmp_path, monkeypatch):
    missing = Cache(tmp_path / "none")
    why = tuning.save(missing, SCOPE, {(4352, 65): LT})
    assert why and "no cache" in why and not missing.root.exists()  # never creates a cache
    os.chmod(cache.base, 0o555)
    try:
        why = tuning.save(cache, SCOPE, {(4352, 65): LT})
        assert why and "read-only" in why and not tuning.tuning_dir(cache).exists()
    finally:
        os.chmod(cache.base, 0o755)

    def full(path, data, mode=0o644):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tuning, "atomic_write", full)
    why = tuning.save(cache, SCOPE, {(4352, 65): LT})
    assert why.count("\n") == 0 and "no space left on device" in why and "musekern gc" in why
    assert tuning.load(cache, SCOPE) == {}


def test_the_shape_bound_keeps_the_newest(cache, monkeypatch):
    monkeypatch.setattr(tuning, "MAX_SHAPES", 5)
    tuning.save(cache, SCOPE, {(1, m): MM for m in range(1, 5)})
    tuning.save(cache, SCOPE, {(2, m): MM for m in range(1, 4)})
    got = tuning.load(cache, SCOPE)
    assert len(got) == 5 and all((2, m) in got for m in range(1, 4))


def test_clean_all_removes_the_records_and_stats_counts_them(cache):
    from click.testing import CliRunner

    from musekern.cli import main

    tuning.save(cache, SCOPE, {(4352, 65): LT, (2176, 65): MM})
    run = CliRunner().invoke
    r = run(main, ["stats", "--cache-dir", str(cache.root), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["gemm_tuning"] == {SCOPE: 2}
    r = run(main, ["stats", "--cache-dir", str(cache.root)])
    assert f"GEMM tuning: 2 shapes measured on {SCOPE}" in r.stdout
    r = run(main, ["clean", "--all", "--dry-run", "--cache-dir", str(cache.root), "--json"])
    assert json.loads(r.stdout)["gemm_tuning_removed"] == [SCOPE] and tuning.summary(cache) == {SCOPE: 2}
    r = run(main, ["clean", "--all", "--cache-dir", str(cache.root)])
    assert r.exit_code == 0 and f"removed GEMM tuning record {SCOPE}" in r.stdout
    assert tuning.summary(cache) == {} and tuning.load(cache, SCOPE) == {}
