"""Signed entries (store/signing.py) and the forged-entry scenarios of issue 28 via a remote and via a bundle.

A forger with write access to a remote or a bundle re-seals a manifest (recomputes its digest). What refuses it:
- without trusted keys: the integrity checks, the declared-ABI check (store/variant_abi.py: a toy provider here,
  the real one is kernels.declared_abi) and the cubin's ELF (arch);
- with trusted keys: a signature by one of them that verifies (unsigned, untrusted signer, or a trusted
  signature over other content: all refused, one line each).
"""
from __future__ import annotations

import base64
import io
import json
import os
import stat
import tarfile
import urllib.request

import pytest
from cubin_headers import elf_header

from musekern.store import signing, variant_abi
from musekern.store.abi import KernelAbi, LaunchSpec, TensorMapSpec, coord_tensor, pointer, scalar, tensormap
from musekern.store.bundle import INDEX_NAME, import_bundle
from musekern.store.cache import Cache
from musekern.store.keys import KeyParts, sha256_hex, variant_tag
from musekern.store.manifest import check, manifest_bytes, seal
from musekern.store.remote import RemoteCache
from musekern.store.signing import SecretKey, SigningError, TrustedKeys

SRC = "cd" * 32


# ---------------------------------------------------------------- a toy kernel whose ABI depends on its variant
def toy_abi(p: dict) -> KernelAbi:
    """A qkv_front-shaped ABI: the x box rows, the cluster, the smem (stages), PDL and an optional coordinate
    parameter all follow the variant, as the real kernels' do."""
    params = [tensormap("tma_w"), tensormap("tma_x")]
    if not p["fixed_m"]:
        params.append(coord_tensor("x_coord", ("M",)))
    params += [pointer("y"), pointer("positions"), scalar("max_pos", "i32"), scalar("k_stride", "i64"),
               scalar("eps", "f32")]
    return KernelAbi(tuple(params), LaunchSpec((128, 1, 1), (p["cluster"], 1, 1), p["stages"] * 16384, p["pdl"]),
                     (TensorMapSpec("tma_w", "weight", "bf16", (64, 64)),
                      TensorMapSpec("tma_x", "x", "bf16", (64, p["rows"]))))


def toy_provider(kernel: str, params: dict):
    if kernel != "toy":
        return None
    if set(params) != {"rows", "cluster", "stages", "pdl", "fixed_m"}:
        raise ValueError(f"unknown params {sorted(params)}")
    return toy_abi(params)


A = {"rows": 8, "cluster": 2, "stages": 4, "pdl": True, "fixed_m": 0}
B = {"rows": 16, "cluster": 4, "stages": 3, "pdl": False, "fixed_m": 8}  # a sibling: every lever differs


def parts_of(p: dict) -> KeyParts:
    return KeyParts.make("toy", p, "sm_90a", SRC, "4.8.1", 1)


def toy_symbol(p: dict) -> str:
    """The entry symbol of the toy's build of `p`: with its variant's tag, as every kernel compiles it."""
    return f"toy_{p['rows']}_{variant_tag('toy', parts_of(p).variant_params)}"


def build(p: dict, arch: str = "sm_90a") -> tuple[bytes, dict]:
    parts = parts_of(p)
    cubin = elf_header(arch, b"toy kernel " + parts.key().encode() * 8)
    return cubin, {"kernel": "toy", "label": parts.label, "variant": parts.variant_params, "symbol": toy_symbol(p),
                   "arch": "sm_90a", "abi": toy_abi(p).to_json(), "built_with": {}}


@pytest.fixture(autouse=True)
def toy_declares():
    with variant_abi.provider(toy_provider):
        yield


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("ci-1", "forger-1"):
        k = signing.generate(name)
        signing.write_secret(k, d / f"{name}.sec")
        out[name] = SecretKey.load(str(d / f"{name}.sec"))
    return out


# ---------------------------------------------------------------- keys
def test_a_key_file_roundtrips_is_0600_and_never_overwritten(tmp_path):
    k = signing.generate("ci.example.org-1")
    f = tmp_path / "k.sec"
    signing.write_secret(k, f)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert SecretKey.load(str(f)) == k and "seed" not in repr(k) and k.public_text.startswith("ci.example.org-1:")
    with pytest.raises(FileExistsError):
        signing.write_secret(signing.generate("other"), f)
    assert SecretKey.load(str(f)) == k


@pytest.mark.parametrize("content,match", [  # what a mistaken or damaged key file looks like
    (b"", "not a musekern secret key"),
    (b"\xff\xfe garbage", "not ASCII"),
    (b"ci-1:" + base64.b64encode(b"x" * 32), "not a musekern secret key"),  # a public key where a secret goes
    (b"ci-1:" + base64.b64encode(b"\1" * 64), "does not belong to its seed"),  # halves of two keys
    (b"a" * (70 << 10), "at most"),
])
def test_bad_secret_key_files_are_one_line_errors(tmp_path, content, match):
    f = tmp_path / "k.sec"
    f.write_bytes(content)
    with pytest.raises(SigningError, match=match) as e:
        SecretKey.load(str(f))
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_a_fifo_or_missing_key_file_neither_hangs_nor_tracebacks(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for p in (tmp_path / "fifo", tmp_path / "none", tmp_path):
        with pytest.raises(SigningError):
            SecretKey.load(str(p))


def test_the_sign_key_variable_takes_a_path_never_the_key(monkeypatch, keys, tmp_path):
    text = (tmp_path / "k").write_text("x") and None
    monkeypatch.setenv("MUSEKERN_SIGN_KEY", "ci-1:" + base64.b64encode(b"\1" * 64).decode())
    with pytest.raises(SigningError, match="path of the key file"):
        SecretKey.from_env()
    monkeypatch.delenv("MUSEKERN_SIGN_KEY")
    assert SecretKey.from_env() is None and text is None


def test_trusted_keys_parse_keys_and_files_and_refuse_mistakes(tmp_path, keys, monkeypatch):
    pub = keys["ci-1"].public_text
    f = tmp_path / "trusted.pub"
    f.write_text(f"# CI\n{keys['forger-1'].public_text}  # rotated out soon\n")
    t = TrustedKeys.parse(f"{pub} {f}", "test")
    assert t.names == ["ci-1", "forger-1"]
    monkeypatch.setenv("MUSEKERN_TRUSTED_KEYS", pub)
    assert TrustedKeys.from_env().names == ["ci-1"] and TrustedKeys.from_env(str(f)).names == ["forger-1"]
    monkeypatch.delenv("MUSEKERN_TRUSTED_KEYS")
    assert not TrustedKeys.from_env()
    other = "ci-1:" + base64.b64encode(b"\2" * 32).decode()
    for text, match in ((f"{pub} {other}", "two different trusted keys"), ("ci-1:abc", "not a public key"),
                        ("ci-1:" + base64.b64encode(b"\1" * 64).decode(), "not a public key"),
                        (str(tmp_path / "missing"), "no such file|No such file")):
        with pytest.raises(SigningError, match=match):
            TrustedKeys.parse(text, "test")


def test_without_cryptography_trusting_keys_is_one_line_naming_the_extra(monkeypatch, keys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "cryptography" else real(n, *a))
    with pytest.raises(SigningError, match=r"musekern\[sign\]"):
        TrustedKeys.from_env(keys["ci-1"].public_text)


def test_the_runtime_import_does_not_load_cryptography():
    import subprocess
    import sys

    code = ("import sys, musekern, musekern.store.cache, musekern.store.lookup; "
            "print('cryptography' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# ---------------------------------------------------------------- signatures in the manifest
def test_a_signed_entry_is_reproducible_and_a_flipped_bit_is_an_integrity_failure(tmp_path, keys):
    c = Cache(tmp_path)
    e = c.put(parts_of(A), *build(A), sign=keys["ci-1"])
    assert signing.signers(e.manifest) == ["ci-1"] and c.verify_entry(e.key) == []
    again = signing.sign_manifest(e.manifest, keys["ci-1"])
    assert again == e.manifest  # ed25519 is deterministic: bundles stay byte-reproducible
    sig = e.manifest["signatures"][0]
    flipped = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
    m = {**e.manifest, "signatures": [flipped]}
    assert any("digest mismatch" in p for p in check(m, e.key))  # no key needed to see the damage
    assert TrustedKeys.parse(keys["ci-1"].public_text, "t").refusal(seal(m))  # and re-sealed: not trusted
    assert TrustedKeys.parse(keys["ci-1"].public_text, "t").refusal(e.manifest) is None


@pytest.mark.parametrize("sigs,match", [([], "list of 1"), (["x"], "not NAME:base64"), (["a:" + "A" * 86 + "=="] * 2,
                                                                                    "one per key name")])
def test_malformed_signature_fields_are_problems(sigs, match, tmp_path):
    e = Cache(tmp_path).put(parts_of(A), *build(A))
    assert any(match in p for p in check(seal({**e.manifest, "signatures": sigs}), e.key))


# ---------------------------------------------------------------- the forgeries
def _sibling_cubin(m, cubins):
    return {**m, "cubin_sha256": sha256_hex(cubins["B"]), "cubin_size": len(cubins["B"]), "symbol": toy_symbol(B)}, "B"


def _edit_abi(fn):
    def edit(m, cubins):
        abi = json.loads(json.dumps(m["abi"]))
        fn(abi)
        return {**m, "abi": abi}, "A"
    return edit


def _swap_names(abi):
    abi["params"][3]["name"], abi["params"][4]["name"] = abi["params"][4]["name"], abi["params"][3]["name"]
    for p in abi["params"][3:5]:
        p["fields"][0]["name"] = p["name"]


FORGERIES = {  # the kinds: a sibling's cubin/symbol/ABI under the key, names swapped, launch changed
    "sibling cubin+symbol (same ABI)": _sibling_cubin,
    "sibling cubin+symbol+ABI": lambda m, c: ({**_sibling_cubin(m, c)[0], "abi": toy_abi(B).to_json()}, "B"),
    "param names swapped": _edit_abi(_swap_names),
    "field renamed": _edit_abi(lambda a: a["params"][2]["fields"][0].update(name="N")),
    "field type changed": _edit_abi(lambda a: a["params"][2]["fields"][0].update(type="u32")),
    "param dropped": _edit_abi(lambda a: a.update(params=a["params"][:2] + a["params"][3:])),
    "cluster changed": _edit_abi(lambda a: a["launch"].update(cluster=[4, 1, 1])),
    "dynamic smem changed": _edit_abi(lambda a: a["launch"].update(dynamic_smem_bytes=3 * 16384)),
    "PDL flipped": _edit_abi(lambda a: a["launch"].update(pdl=False)),
    "block changed": _edit_abi(lambda a: a["launch"].update(block=[256, 1, 1])),
    "tensor map box changed": _edit_abi(lambda a: a["tensormaps"][1].update(box=[64, 16])),
    "tensor maps swapped": _edit_abi(lambda a: (a["tensormaps"][0].update(tensor="x"),
                                                a["tensormaps"][1].update(tensor="weight"))),
    "sm_100a cubin": lambda m, c: ({**m, "cubin_sha256": sha256_hex(c["A100"]), "cubin_size": len(c["A100"])},
                                   "A100"),
}
MODES = {  # (what the forger does with the signatures, what the consumer trusts)
    "unsigned, nothing trusted": ("strip", False),
    "unsigned, ci-1 trusted": ("strip", True),
    "forger-signed, ci-1 trusted": ("forger", True),
    "ci-1's signature kept, ci-1 trusted": ("keep", True),
}


def _forge(kind: str, mode: str, keys) -> tuple[KeyParts, bytes, bytes]:
    """(parts, manifest bytes, cubin) of a re-sealed forgery under A's key."""
    cubins = {"A": build(A)[0], "B": build(B)[0], "A100": build(A, "sm_100a")[0]}
    genuine = Cache.__new__(Cache)  # only _full_manifest: the producer's signed manifest of A
    m = genuine._full_manifest(parts_of(A), cubins["A"], build(A)[1], keys["ci-1"])
    forged, which = FORGERIES[kind](m, cubins)
    sigs, _ = MODES[mode]
    forged = {k: v for k, v in forged.items() if k != "signatures"} if sigs == "strip" else forged
    forged = seal(forged)
    if sigs == "forger":
        forged = signing.sign_manifest({k: v for k, v in forged.items() if k != "signatures"}, keys["forger-1"])
    return parts_of(A), manifest_bytes(forged), cubins[which]


def _bundle(path, entries) -> None:
    index = {"bundle_format": 1, "cache_format": 2, "entries": [
        {"key": p.key(), "kernel": "toy", "arch": "sm_90a", "label": p.label, "manifest_sha256": sha256_hex(mb),
         "cubin_sha256": sha256_hex(cb), "cubin_size": len(cb)} for p, mb, cb in entries]}
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [(INDEX_NAME, manifest_bytes(index))] + [
                (f"entries/{p.key()}/{n}", d) for p, mb, cb in entries for n, d in (("manifest.json", mb),
                                                                                   ("kernel.cubin", cb))]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))


def _trust(trusted: bool, keys) -> TrustedKeys:
    return TrustedKeys.parse(keys["ci-1"].public_text, "MUSEKERN_TRUSTED_KEYS") if trusted else TrustedKeys()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", FORGERIES)
def test_a_forged_bundle_entry_is_refused(tmp_path, keys, kind, mode):
    parts, mb, cb = _forge(kind, mode, keys)
    _bundle(tmp_path / "b.tar", [(parts, mb, cb)])
    c = Cache(tmp_path / "c")
    report = import_bundle(c, tmp_path / "b.tar", _trust(MODES[mode][1], keys))
    # every kind in every mode: a same-ABI sibling too, unsigned, by the variant's tag its cubin's symbol lacks
    assert report.added == [] and c.get(parts.key()) is None, report.to_json()
    (key, reason), = report.rejected
    assert "\n" not in reason and len(reason) <= 600
    if MODES[mode][1] and kind not in ("sm_100a cubin",):
        assert "not trusted" in reason or "declares" in reason, reason


@pytest.mark.parametrize("trusted", [False, True])
def test_the_genuine_signed_entry_passes_both_channels(tmp_path, keys, nginx_server, trusted):
    c = Cache(tmp_path / "prod")
    e = c.put(parts_of(A), *build(A), sign=keys["ci-1"])
    from musekern.store.bundle import export_bundle

    export_bundle(c, [e.key], tmp_path / "b.tar.gz")
    assert import_bundle(Cache(tmp_path / "c1"), tmp_path / "b.tar.gz", _trust(trusted, keys)).added == [e.key]
    url, _ = nginx_server
    assert RemoteCache(url, upload=True).push(e, c)
    got = RemoteCache(url, trusted=_trust(trusted, keys)).pull(parts_of(A), Cache(tmp_path / "c2"))
    assert got is not None and signing.signers(got.manifest) == ["ci-1"]


def _put(url: str, path: str, data: bytes) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{url}/{path}", data=data, method="PUT"), timeout=10).close()


@pytest.mark.parametrize("mode", MODES)
def test_forged_remote_entries_are_refused(tmp_path, keys, nginx_server, mode):
    """Every kind in one remote (one nginx per mode): the remote holds each forgery under A's key in turn."""
    url, _ = nginx_server
    outcomes = {}
    for kind in FORGERIES:
        parts, mb, cb = _forge(kind, mode, keys)
        _put(url, f"cas/{sha256_hex(cb)}", cb)
        _put(url, f"ac/{parts.key()}", mb)
        r = RemoteCache(url, trusted=_trust(MODES[mode][1], keys))
        c = Cache(tmp_path / kind.replace(" ", "_").replace("+", "_"))
        got = r.pull(parts, c)
        outcomes[kind] = got is not None
        if got is None:
            assert r.stats["rejected"] == 1 and len(r.warnings) == 1 and "\n" not in r.warnings[0], r.warnings
            assert c.get(parts.key()) is None
    assert not any(outcomes.values()), outcomes


def test_push_signs_what_it_uploads_and_a_trusting_prepare_pulls_it(tmp_path, keys, nginx_server):
    url, root = nginx_server
    c = Cache(tmp_path / "ci")
    e = c.put(parts_of(A), *build(A))  # built unsigned (an older cache): signed on the way out
    assert RemoteCache(url, upload=True, sign_key=keys["ci-1"]).push(e, c)
    pulled = json.loads((root / "ac" / e.key).read_bytes())
    assert signing.signers(pulled) == ["ci-1"]
    assert RemoteCache(url, trusted=_trust(True, keys)).pull(parts_of(A), Cache(tmp_path / "d")) is not None
    r = RemoteCache(url, trusted=TrustedKeys.parse(keys["forger-1"].public_text, "--trusted-keys"))
    assert r.pull(parts_of(A), Cache(tmp_path / "e")) is None
    assert "signed only by untrusted key ci-1; --trusted-keys trusts forger-1" in r.warnings[0]
