"""Hostile files in an entry never crash, hang or exhaust memory: a directory, a symlink loop, a FIFO, a link to
/dev/zero or an unreadable file where kernel.cubin or manifest.json should be is one problem naming the path.

Each check runs in a child process with a time limit and an address-space limit, so a hang or an unbounded
read fails the test instead of the test run; an unreadable file is made unreadable for real (as root: the child
runs as `nobody`, since root reads through mode bits).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_fakes import as_other_user, fake_parts, put

from musekern.store.cache import Cache

ROOT = Path(__file__).resolve().parents[1]


def check_in_child(root: Path, key: str, prefix=(), timeout: float = 20) -> dict:
    """verify_entry and load of `key` in a child with a 1 GiB address-space limit: {"verify": problems,
    "load": the error's class and message}."""
    code = textwrap.dedent(f"""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from musekern.store.cache import Cache, CacheError
        c = Cache({str(root)!r})
        out = {{"verify": c.verify_entry({key!r})}}
        try:
            c.load({key!r})
            out["load"] = None
        except CacheError as e:
            out["load"] = [type(e).__name__, str(e)]
        print(json.dumps(out))
    """)
    r = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _replace(path: Path, how: str) -> None:
    path.unlink()
    if how == "directory":
        path.mkdir()
    elif how == "symlink_loop":
        os.symlink(path.name, path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "dev_zero":
        os.symlink("/dev/zero", path)


# (before the fix a manifest.json that was a directory or a symlink loop was already one problem; the others
# crashed verify, hung it (FIFO) or read until MemoryError (/dev/zero))
@pytest.mark.parametrize("name", ["kernel.cubin", "manifest.json"])
@pytest.mark.parametrize("how", ["directory", "symlink_loop", "fifo", "dev_zero"])
def test_non_regular_entry_files_are_one_problem_naming_the_file(world_dir, name, how):
    c = Cache(world_dir / "cache")
    p = fake_parts()
    e = put(c, p)
    _replace(e.path / name, how)
    try:
        out = check_in_child(c.root, p.key())
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} as a {how} hangs verify")
    assert out["verify"] and any(name in problem for problem in out["verify"]), out
    assert out["load"][0] == "CorruptEntryError" and "\n" not in out["load"][1]


@pytest.mark.parametrize("name", ["kernel.cubin", "manifest.json"])
def test_unreadable_entry_file_is_one_problem(world_dir, name):
    c = Cache(world_dir / "cache")
    p = fake_parts()
    e = put(c, p)
    os.chmod(e.path / name, 0o000)
    out = check_in_child(c.root, p.key(), as_other_user())
    assert out["verify"] and any(name in problem and "permission" in problem.lower() for problem in out["verify"])
    assert out["load"][0] == "CorruptEntryError"


@pytest.mark.parametrize("payload", ["[" * 100_000 + "]" * 100_000, None])
def test_nested_json_and_huge_numbers_in_a_manifest_are_problems(tmp_path, payload):
    """A manifest of deeply nested JSON (RecursionError before) or abi_version 1e999 (OverflowError)."""
    c = Cache(tmp_path / "cache")
    p = fake_parts()
    e = put(c, p)
    os.chmod(e.manifest_path, 0o644)
    if payload is None:
        text = e.manifest_path.read_text().replace('"abi_version": 1', '"abi_version": 1e999')
    else:
        text = payload
    e.manifest_path.write_text(text)
    problems = c.verify_entry(p.key())
    assert problems and "\n" not in "; ".join(problems)


# read_regular(follow_symlinks=True) is for a file the user names (--model: the HF hub keeps config.json as a symlink
# into blobs/): the link is followed, what it points at must still be a regular file within the limit; `reason`
# says what is wrong without the path or the store's fix. Without it a link stays refused (the store writes none).
@pytest.mark.parametrize("target,follow,want", [
    ("file", True, b"{}"), ("file", False, "symbolic link"), ("/dev/zero", True, "is a character device"),
    ("big", True, "is 5 bytes, more than the 4"),
])
def test_read_regular_follows_a_symlink_only_when_asked(tmp_path, target, follow, want):
    from musekern.store.fs import ReadProblem, read_regular

    (tmp_path / "file").write_bytes(b"{}")
    (tmp_path / "big").write_bytes(b"12345")
    link = tmp_path / "link"
    link.symlink_to(target if target.startswith("/") else tmp_path / target)
    if isinstance(want, bytes):
        assert read_regular(link, 4, follow_symlinks=follow) == want
        return
    with pytest.raises(ReadProblem) as ei:
        read_regular(link, 4, follow_symlinks=follow)
    assert want in ei.value.reason and str(link) not in ei.value.reason and str(link) in str(ei.value)
