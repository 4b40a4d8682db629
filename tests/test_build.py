"""build: the CPU-only compile path and the checks an artifact passes before it may enter the cache."""
import importlib.util

import pytest
from cubin_headers import elf_header

from musekern.builder import BuildError, BuildExtraMissing, build_variant
from musekern.kernels.qk_norm.variant import QkNormVariant
from musekern.store import keys
from musekern.store.abi import ABI_VERSION, KernelAbi, check_abi_against_ptx, cubin_arch
from musekern.store.keys import key_parts, source_hash

HAVE_DSL = importlib.util.find_spec("cutlass") is not None
V = QkNormVariant("bfloat16", 128, False)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_90", "sm_100a", "sm_100"])
def test_cubin_arch_decodes_both_elf_layouts(arch):
    assert cubin_arch(elf_header(arch)) == arch


def test_cubin_arch_rejects_non_cubins():
    with pytest.raises(ValueError, match="not an ELF"):
        cubin_arch(b"\x7fELX" + b"\0" * 60)
    with pytest.raises(ValueError, match="not CUDA"):
        cubin_arch(elf_header(machine=62))  # x86-64


def test_key_parts_are_named_and_complete():
    p = key_parts(V, "sm_90a", "4.8.1")
    d = p.to_json()
    assert d["kernel"] == "qk_norm" and d["arch"] == "sm_90a" and d["dsl_version"] == "4.8.1"
    assert d["abi_version"] == ABI_VERSION and d["source_sha256"] == source_hash(V.source_files())
    assert dict(p.variant) == V.params()
    # every part moves the key
    others = [key_parts(QkNormVariant("bfloat16", 128, True), "sm_90a", "4.8.1"), key_parts(V, "sm_100a", "4.8.1"),
              key_parts(V, "sm_90a", "4.9.0")]
    assert len({p.key(), *(o.key() for o in others)}) == 4


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_120a"])  # an A100, an L40S, a consumer Blackwell
def test_the_builder_builds_only_the_supported_arches(arch):
    """targets.SUPPORTED_ARCHES is the one list: the builder refuses any other arch before it imports the DSL."""
    from musekern.builder.compile import compile_variant

    with pytest.raises(NotImplementedError, match=f"{arch} is not supported"):
        compile_variant(V, arch)


def test_missing_build_extra_says_what_to_install(monkeypatch):
    monkeypatch.setattr("musekern.builder.compile.dsl_version", lambda: None)
    with pytest.raises(BuildExtraMissing, match=r"musekern\[build\]"):
        build_variant(V, "sm_90a")


@pytest.mark.skipif(not HAVE_DSL, reason="needs the build extra (nvidia-cutlass-dsl)")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_build_checks_arch_and_abi(arch):
    b = build_variant(V, arch)
    assert cubin_arch(b.cubin) == arch
    m = b.manifest
    assert m["arch"] == arch and m["kernel"] == "qk_norm" and m["variant"] == V.params()
    assert m["built_with"]["nvidia-cutlass-dsl"] == keys.dsl_version()
    abi = KernelAbi.from_json(m["abi"])
    assert [p.name for p in abi.params] == ["x", "out", "m", "heads", "ld_x", "ld_out", "eps", "scale"]


@pytest.mark.skipif(not HAVE_DSL, reason="needs the build extra (nvidia-cutlass-dsl)")
def test_manifest_abi_matches_ptx_entry():
    """The ABI written to the manifest is checked against the `.entry` of the PTX the cubin came from."""
    from musekern.builder.compile import compile_variant

    ck = compile_variant(V, "sm_90a")
    check_abi_against_ptx(KernelAbi.from_json(build_variant(V, "sm_90a").manifest["abi"]), ck.ptx, ck.symbol)


@pytest.mark.skipif(not HAVE_DSL, reason="needs the build extra (nvidia-cutlass-dsl)")
def test_wrong_arch_artifact_is_refused(monkeypatch):
    from musekern.builder import compile as builder

    real = builder.compile_variant
    monkeypatch.setattr(builder, "compile_variant", lambda v, arch: real(v, "sm_100a"))
    with pytest.raises(BuildError, match="asked for sm_90a, the cubin's ELF header says sm_100a"):
        build_variant(V, "sm_90a")
