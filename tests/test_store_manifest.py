"""The manifest's integrity: every field the loader uses (ABI, symbol, label, variant, launch config, tensor
maps, key parts, cubin hash and size) is bound to the cubin's hash and the key, on load and verify."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
from store_fakes import chmod_w, fake_cubin, fake_manifest, fake_parts, put, real_builds

from musekern.store import manifest
from musekern.store.cache import Cache, CorruptEntryError

SCALE = float(os.environ.get("STORE_STRESS_SCALE", "1"))  # > 1: the full on-disk sweep (see test_store_hygiene)


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


# ---------------------------------------------------------------- the digest and the re-derived fields
def test_a_committed_manifest_is_sealed_canonical_and_self_consistent(cache):
    p = fake_parts()
    e = put(cache, p)
    raw = e.manifest_path.read_bytes()
    m = json.loads(raw)
    assert m["digest"] == manifest.digest_of(m) and raw == manifest.manifest_bytes(m)
    assert manifest.check(m, p.key(), raw) == []
    assert manifest.check(m, "0" * 64, raw)  # another key's directory: foreign


def test_a_resealed_edit_of_a_derived_field_is_still_caught(cache):
    """Re-computing the digest does not make an edit of what the key determines pass (kernel, arch, variant,
    label, abi version): those are re-derived from key_parts, and key_parts from the key."""
    p = fake_parts()
    e = put(cache, p)
    m = json.loads(e.manifest_path.read_bytes())
    for change in ({"label": "qk_norm[x=1]"}, {"variant": {"head_dim": 128}}, {"arch": "sm_100a"}, {"kernel": "x"}):
        forged = manifest.seal({**m, **change})
        assert manifest.check(forged, p.key()), change
    kp = dict(m["key_parts"], arch="sm_100a")
    assert any("different key" in x for x in manifest.check(manifest.seal({**m, "key_parts": kp}), p.key()))


def test_put_refuses_a_manifest_that_load_would_refuse(cache):
    p = fake_parts()
    bad = fake_manifest(p)
    bad["abi"]["launch"]["block"] = [4096, 1, 1]
    with pytest.raises(ValueError, match="block"):
        cache.put(p, fake_cubin(p), bad)
    assert cache.entry_keys() == []


# ---------------------------------------------------------------- bounded parsing, bounded ABI values
@pytest.mark.parametrize("raw,why", [
    (b"[" * 40 + b"]" * 40, "nests deeper"),
    (b'{"a": 1e999}', "out of range"),
    (b'{"a": NaN}', "not JSON"),
    (b'{"a": -Infinity}', "not JSON"),
    (b'{"a": ' + b"9" * 400 + b"}", "digits"),
    (b'{"a": "\xff"}', "not UTF-8"),
    (b'{"a": [1, 2', "not valid JSON"),
])
def test_parse_json_refuses_what_would_crash_or_exhaust_a_reader(raw, why):
    """Each of these was a RecursionError, an OverflowError further on, or silently accepted."""
    with pytest.raises(ValueError, match=why):
        manifest.parse_json(raw, "x.json")


def test_parse_json_takes_real_nesting():
    assert manifest.parse_json(b"[" * 32 + b"]" * 32, "x") is not None
    assert manifest.parse_json(b'{"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "n": 1.5}', "x")["n"] == 1.5


# Each value the loader allocates or packs from, pushed out of bounds or given the wrong type (the grid is the
# fields of manifest.check_abi, one bad value each).
ABI_EDITS = {
    "param size 10**12": lambda a: a["params"][0].update(size=10**12),
    "param align 3": lambda a: a["params"][0].update(align=3),
    "param kind": lambda a: a["params"][0].update(kind="texture"),
    "field type": lambda a: a["params"][0]["fields"][0].update(type="f128"),
    "field offset past the param": lambda a: a["params"][2]["fields"][0].update(offset=8),
    "bool as int": lambda a: a["params"][0].update(size=True),
    "block 2048 threads": lambda a: a["launch"].update(block=[2048, 1, 1]),
    "block of 2": lambda a: a["launch"].update(block=[256, 1]),
    "cluster 32": lambda a: a["launch"].update(cluster=[32, 1, 1]),
    "smem 1 GiB": lambda a: a["launch"].update(dynamic_smem_bytes=1 << 30),
    "pdl 1": lambda a: a["launch"].update(pdl=1),
    "tensormap of a pointer": lambda a: a["tensormaps"].append(
        {"param": "x", "tensor": "w", "dtype": "bf16", "box": [64, 64], "swizzle": "128B", "l2_promotion": "128B",
         "oob_fill": "none", "interleave": "none"}),
    "params not a list": lambda a: a.update(params={}),
    "abi version 2": lambda a: a.update(abi_version=2),
}


@pytest.mark.parametrize("edit", sorted(ABI_EDITS))
def test_an_out_of_bounds_abi_is_a_problem_not_a_crash(edit):
    p = fake_parts()
    m = fake_manifest(p)
    ABI_EDITS[edit](m["abi"])
    with pytest.raises(ValueError):
        manifest.check_abi(m["abi"])


# ---------------------------------------------------------------- a real cubin vouches for its ABI
def test_another_variants_cubin_under_a_resealed_manifest_is_caught():
    """A consistent forgery (digest recomputed, sha256/size pointing at another variant's real cubin, as a remote
    whose ac/<key> names another variant's blob would serve): the cubin's own ELF names another kernel."""
    (pa, ca, ma), (pb, cb, mb) = real_builds()
    full_a = Cache.__new__(Cache)._full_manifest(pa, ca, ma)
    assert manifest.cubin_problems(full_a, ca) == []
    forged = manifest.seal({**full_a, "cubin_sha256": hashlib.sha256(cb).hexdigest(), "cubin_size": len(cb)})
    assert manifest.check(forged, pa.key()) == []  # consistent as a manifest ...
    problems = manifest.cubin_problems(forged, cb)  # ... but not for that cubin
    assert problems and "has no kernel" in problems[0]
    # the same symbol with another parameter list or block is caught too
    params = [dict(q, size=8) for q in full_a["abi"]["params"]]
    for abi in ({**full_a["abi"], "params": params},
                {**full_a["abi"], "launch": {**full_a["abi"]["launch"], "block": [128, 1, 1]}}):
        assert manifest.cubin_problems(manifest.seal({**full_a, "abi": abi}), ca)


def _flips(raw: bytes, step: int = 1):
    for bit in range(0, len(raw) * 8, step):
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        yield bit, bytes(bad)


def test_every_single_bit_flip_of_a_real_manifest_is_caught(tmp_path):
    """Every bit of a real compiled entry's manifest.json, flipped one at a time: 100% caught by the checks
    `Cache.load` and `verify` run (the review: 34% passed, 40 of them changing the launch). In CI every third bit
    in memory (every byte gets two or three flips) and every 97th through load and verify on disk; with
    STORE_STRESS_SCALE > 1 every bit, both ways."""
    (p, cubin, m), _ = real_builds()
    c = Cache(tmp_path / "c")
    e = c.put(p, cubin, m)
    good = e.manifest_path.read_bytes()
    missed = []
    step = 3 if SCALE == 1 else 1
    for bit, bad in _flips(good, step):
        try:
            parsed = manifest.parse_json(bad, "manifest.json")
        except ValueError:
            continue
        if not manifest.check(parsed, p.key(), bad) and not manifest.cubin_problems(parsed, cubin):
            missed.append(bit)
    in_memory = len(range(0, len(good) * 8, step))
    assert not missed, f"{len(missed)} of {in_memory} flips not caught, e.g. bit {missed[0]}"
    chmod_w(e.manifest_path)
    on_disk = 0
    for _, bad in _flips(good, step=97 if SCALE == 1 else 1):
        e.manifest_path.write_bytes(bad)
        with pytest.raises(CorruptEntryError):
            c.load(p.key())
        assert c.verify_entry(p.key())
        on_disk += 1
    e.manifest_path.write_bytes(good)
    assert c.load(p.key())[1] == cubin
    print(f"\nbit flips of a {len(good)}-byte manifest: {in_memory} in memory, {on_disk} through load and "
          f"verify on disk; caught {in_memory} and {on_disk} (100%)")
