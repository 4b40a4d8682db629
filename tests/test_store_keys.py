"""store/keys.py: a key is stable, every named part moves it, and its parts round-trip through JSON."""
from __future__ import annotations

import json

import pytest
from store_fakes import SRC, fake_parts

from musekern.store.keys import PART_NAMES, KeyParts


def test_key_is_stable_and_independent_of_param_order():
    a = KeyParts.make("qk_norm", {"dtype": "bfloat16", "head_dim": 64}, "sm_90a", SRC, "4.8.1", 1)
    b = KeyParts.make("qk_norm", {"head_dim": 64, "dtype": "bfloat16"}, "sm_90a", SRC, "4.8.1", 1)
    assert a == b and a.key() == b.key() and len(a.key()) == 64
    assert KeyParts.from_json(json.loads(json.dumps(a.to_json()))) == a
    assert set(a.to_json()) == set(PART_NAMES)
    assert a.label == "qk_norm[dtype=bfloat16,head_dim=64]"


@pytest.mark.parametrize("change", [
    dict(kernel="qkv_front"), dict(i=1), dict(arch="sm_100a"), dict(src="cd" * 32), dict(dsl="4.9.0"), dict(abi=2)])
def test_every_named_part_changes_the_key(change):
    """Invalidation you can explain: source, variant, arch, DSL and ABI version all feed the key."""
    base = fake_parts(0)
    other = fake_parts(**{"i": 0, **change})
    assert other.key() != base.key()
    assert len(other.differences(base)) == 1


def test_key_parts_from_json_rejects_unknown_or_missing_parts():
    d = fake_parts().to_json()
    with pytest.raises(ValueError):
        KeyParts.from_json({**d, "extra": 1})
    d.pop("arch")
    with pytest.raises(ValueError):
        KeyParts.from_json(d)


def test_family_ignores_only_the_dsl_version():
    a = fake_parts(dsl="4.8.1")
    assert a.family() == fake_parts(dsl="5.0").family() != fake_parts(dsl="4.8.1", arch="sm_100a").family()
    assert a.family() != a.key()
