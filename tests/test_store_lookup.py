"""store/lookup.py: the exact key, another DSL version's build by policy (through the family index), and
the nearest entry a miss message names."""
from __future__ import annotations

import os
import shutil

import pytest
from store_fakes import fake_cubin, fake_manifest, fake_parts

from musekern.store import lookup
from musekern.store.cache import Cache
from musekern.store.keys import PART_NAMES
from musekern.store.lookup import Policy

EXACT = Policy(other_dsl=False, verify=False)
ANY_DSL = Policy(other_dsl=True, verify=False)


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "cache")


def test_find_any_dsl_version_picks_highest_version(cache):
    wanted = fake_parts(dsl="")  # the runtime has no cutlass: it does not know the DSL version
    for v in ("4.9.1", "4.10.0", "4.8.1"):
        q = fake_parts(dsl=v)
        cache.put(q, fake_cubin(q), fake_manifest(q))
    other_arch = fake_parts(arch="sm_100a", dsl="5.0.0")
    cache.put(other_arch, fake_cubin(other_arch), fake_manifest(other_arch))
    assert lookup.find(cache, wanted, EXACT) is None
    hit = lookup.find(cache, wanted, ANY_DSL)
    assert hit is not None and hit.parts.dsl_version == "4.10.0"
    exact = fake_parts(dsl="4.8.1")
    assert lookup.find(cache, exact, ANY_DSL).key == exact.key()


def test_find_any_dsl_version_reads_the_family_index_not_every_manifest(cache, monkeypatch):
    """The runtime's lookup lists one index directory; the scan of every entry is only the fallback."""
    wanted = fake_parts(dsl="")
    for v in ("4.9.1", "4.10.0"):
        q = fake_parts(dsl=v)
        cache.put(q, fake_cubin(q), fake_manifest(q))
    for i in range(5):  # unrelated entries the scan would have to read
        q = fake_parts(i + 1, dsl="4.10.0")
        cache.put(q, fake_cubin(q), fake_manifest(q))
    marks = sorted(os.listdir(cache.index_dir / wanted.family()))
    assert marks == sorted(fake_parts(dsl=v).key() for v in ("4.9.1", "4.10.0"))

    def no_scan(self):
        raise AssertionError("scanned every entry")

    monkeypatch.setattr(Cache, "entries", no_scan)
    assert lookup.find(cache, wanted, ANY_DSL).parts.dsl_version == "4.10.0"
    cache.remove(fake_parts(dsl="4.10.0").key())  # removing an entry drops its marker
    assert os.listdir(cache.index_dir / wanted.family()) == [fake_parts(dsl="4.9.1").key()]
    assert lookup.find(cache, wanted, ANY_DSL).parts.dsl_version == "4.9.1"


def test_find_without_index_or_with_a_dangling_marker_falls_back_to_the_scan(cache):
    """Caches written before the index existed, and markers whose entry vanished, still resolve."""
    wanted = fake_parts(dsl="")
    q = fake_parts(dsl="4.8.1")
    cache.put(q, fake_cubin(q), fake_manifest(q))
    shutil.rmtree(cache.index_dir)
    assert lookup.find(cache, wanted, ANY_DSL).key == q.key()
    (cache.index_dir / wanted.family()).mkdir(parents=True)
    (cache.index_dir / wanted.family() / fake_parts(dsl="9.9.9").key()).touch()  # no such entry
    assert lookup.find(cache, wanted, ANY_DSL).key == q.key()


def test_nearest_names_the_differing_part(cache):
    assert lookup.nearest(cache, fake_parts()) == (None, list(PART_NAMES))
    have = fake_parts(dsl="4.8.1")
    cache.put(have, fake_cubin(have), fake_manifest(have))
    q = fake_parts(3)
    cache.put(q, fake_cubin(q), fake_manifest(q))
    entry, diff = lookup.nearest(cache, fake_parts(dsl="4.9.0"))
    assert entry.key == have.key() and diff == ["dsl_version"]
    msg = lookup.explain_miss(cache, fake_parts(dsl="4.9.0"))
    assert "dsl_version" in msg and "4.9.0" in msg and "4.8.1" in msg
    entry, diff = lookup.nearest(cache, fake_parts(src="cd" * 32))
    assert diff == ["source_sha256"]
    assert lookup.nearest(cache, have) == (cache.get(have.key()), [])
    # a variant param difference is itemised
    lines = fake_parts(2).describe_differences(have)
    assert any(line.startswith("variant.i:") for line in lines)


def test_a_damaged_entry_is_named_not_missed_unless_the_policy_verifies(cache):
    """A manifest that does not parse: without `verify` the lookup returns it (empty manifest) so that
    `Cache.load` names it as corrupt; with `verify` it is a miss (prepare rebuilds it)."""
    exact = fake_parts(dsl="4.8.1")
    e = cache.put(exact, fake_cubin(exact), fake_manifest(exact))
    os.chmod(e.manifest_path, 0o644)
    e.manifest_path.write_bytes(b'{"truncated": ')
    for wanted, policy in ((exact, EXACT), (fake_parts(dsl=""), ANY_DSL)):
        hit = lookup.find(cache, wanted, policy)
        assert hit is not None and hit.key == exact.key() and hit.manifest == {}
        assert lookup.find(cache, wanted, Policy(other_dsl=policy.other_dsl, verify=True)) is None
