"""store/owndirs.py: the cache's own directories are never followed out of the cache.

Each primitive is met with a symbolic link (to an outside directory of sentinel files), a file and a FIFO where a
directory should be, at each depth below the cache directory; the outside directory must come out untouched and
the error must be one line naming the path and the fix. The cache directory itself may be a link (the user's
choice). The commands that use these (every maintenance path) are tested with each directory planted in
test_cli_cache.py and test_prepare.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from store_fakes import tree

from musekern.store import owndirs
from musekern.store.owndirs import NotOwnDirError


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    for name in ("a", "b.json", "hit", "sub/c"):
        (out / name).write_text("sentinel")
    return out


def _plant(path: Path, how: str, outside: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "symlink":
        path.symlink_to(outside, target_is_directory=True)
    elif how == "file":
        path.write_text("x")
    elif how == "fifo":
        os.mkfifo(path)


# the three kinds of thing where a directory should be, at the first and the second level below the cache dir
# (v2/ and v2/tmp: every own directory is one of these two depths, index/<family>/ a third, covered by `depth`)
@pytest.mark.parametrize("how", ["symlink", "file", "fifo"])
@pytest.mark.parametrize("rel", ["v2", "v2/tmp", "v2/index/fam"])
def test_every_primitive_refuses_what_is_not_a_real_directory(tmp_path, how, rel):
    root, outside = tmp_path / "cache", _outside(tmp_path)
    root.mkdir()
    before = tree(outside)
    _plant(root / rel, how, outside)
    target = root / "v2" / "index" / "fam" if rel != "v2/tmp" else root / rel
    with pytest.raises(NotOwnDirError) as e:
        owndirs.check([root / rel], "clean")
    msg = str(e.value)
    assert "\n" not in msg and str(root / rel) in msg and f"rm {root / rel}" in msg and "musekern clean" in msg
    assert ("symbolic link to " + str(outside)) in msg if how == "symlink" else how.replace("fifo", "FIFO") in msg
    for act in (lambda: owndirs.make(root, target / "deeper"),
                lambda: owndirs.unlink(root, target / "a"),
                lambda: owndirs.opened(root, target, create=True).__enter__()):
        with pytest.raises(NotOwnDirError):
            act()
    assert tree(outside) == before  # nothing created, removed or changed out there


def test_a_linked_cache_directory_is_the_users_choice(tmp_path):
    real = tmp_path / "real"
    (real / "v2" / "tmp").mkdir(parents=True)
    (real / "v2" / "tmp" / "x").write_text("debris")
    link = tmp_path / "cache"
    link.symlink_to(real)
    owndirs.check([link / "v2", link / "v2" / "tmp"])
    assert owndirs.unlink(link, link / "v2" / "tmp" / "x") and not (real / "v2" / "tmp" / "x").exists()


def test_remove_never_follows_a_link_inside_and_names_lists_without_following(tmp_path):
    root, outside = tmp_path / "cache", _outside(tmp_path)
    d = root / "v2" / "tmp"
    owndirs.make(root, d)
    (d / "link").symlink_to(outside)
    (d / "tree" / "deep").mkdir(parents=True)
    (d / "tree" / "deep" / "inner-link").symlink_to(outside)
    (d / "tree" / "f").write_text("x")
    before = tree(outside)
    with owndirs.opened(root, d) as fd:
        assert owndirs.names(fd) == ["link", "tree"]
        assert owndirs.remove(fd, "link") and owndirs.remove(fd, "tree") and not owndirs.remove(fd, "absent")
    assert os.listdir(d) == [] and tree(outside) == before


def test_missing_directories_are_none_or_made(tmp_path):
    root = tmp_path / "cache"
    with owndirs.opened(root, root / "v2" / "stats") as fd:
        assert fd is None and not root.exists()
    assert owndirs.unlink(root, root / "v2" / "used" / "k") is False
    owndirs.make(root, root / "v2" / "index" / "fam")
    assert (root / "v2" / "index" / "fam").is_dir()
    owndirs.check([root / "v2", root / "nothing"])  # a missing directory is no problem: it is made when needed
    with pytest.raises(ValueError):
        owndirs.make(root, root / ".." / "escape")


def test_a_directory_swapped_for_a_link_after_the_check_is_refused_at_the_act(tmp_path):
    """The race the up-front check cannot close: the walk through fds refuses the link it meets."""
    root, outside = tmp_path / "cache", _outside(tmp_path)
    owndirs.make(root, root / "v2" / "used")
    owndirs.check([root / "v2" / "used"])
    os.rmdir(root / "v2" / "used")
    (root / "v2" / "used").symlink_to(outside)
    before = tree(outside)
    with pytest.raises(NotOwnDirError):
        owndirs.unlink(root, root / "v2" / "used" / "a")
    assert tree(outside) == before
