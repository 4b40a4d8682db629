"""The variant-vs-ABI check (store/variant_abi.py): strict on everything a launch reads, silent on the human text,
and a hook the store itself never fills (`import musekern` registers kernels.declared_abi)."""
from __future__ import annotations

import copy
import importlib.util

import pytest

from musekern.store import variant_abi
from musekern.store.abi import KernelAbi, LaunchSpec, TensorMapSpec, coord_tensor, pointer, scalar, tensormap

ABI = KernelAbi((tensormap("tma_x"), coord_tensor("x_coord", ("M",)), pointer("y"), scalar("eps", "f32")),
                LaunchSpec((128, 1, 1), (2, 1, 1), 65536, True, grid="(heads, 1, 1)"),
                (TensorMapSpec("tma_x", "x", "bf16", (64, 8)),))


def _edit(fn) -> dict:
    d = copy.deepcopy(ABI.to_json())
    fn(d)
    return d


# One edit per thing a launch reads (each must be named), and the human text (which must not matter).
EDITS = {
    "launch.block": lambda d: d["launch"].update(block=[256, 1, 1]),
    "launch.cluster": lambda d: d["launch"].update(cluster=[1, 1, 1]),
    "launch.dynamic_smem_bytes": lambda d: d["launch"].update(dynamic_smem_bytes=0),
    "launch.pdl": lambda d: d["launch"].update(pdl=False),
    "params[2] 'z': name": lambda d: d["params"][2].update(name="z"),
    "params[3] 'eps': kind, size, align, fields": lambda d: d["params"].__setitem__(3, pointer("eps").__dict__ | {
        "fields": [{"name": "eps", "type": "u64", "offset": 0, "size": 8}]}),
    "params: recorded 3": lambda d: d["params"].pop(1),
    "tensormaps[0]: box": lambda d: d["tensormaps"][0].update(box=[64, 16]),
    "tensormaps[0]: swizzle": lambda d: d["tensormaps"][0].update(swizzle="64B"),
    "tensormaps: recorded 0": lambda d: d.update(tensormaps=[]),
}


@pytest.mark.parametrize("what", EDITS)
def test_every_launch_relevant_difference_is_named(what):
    diff = variant_abi.differences(ABI.to_json(), _edit(EDITS[what]))
    assert diff and any(d.startswith(what) for d in diff), diff


def test_docs_and_the_grid_rule_are_not_compared():
    d = _edit(lambda d: (d["params"][0].update(doc="other words"), d["launch"].update(grid="another rule")))
    assert variant_abi.differences(ABI.to_json(), d) == []


def test_the_hook_answers_by_its_provider():
    rec = _edit(EDITS["launch.pdl"])
    with variant_abi.provider(None):
        assert variant_abi.problems("k", {}, "k[]", rec) == []  # nothing registered: nothing to check
    with variant_abi.provider(lambda k, p: None):
        assert variant_abi.problems("k", {}, "k[]", rec) == []  # declares nothing for this kernel
    with variant_abi.provider(lambda k, p: ABI):
        (problem,) = variant_abi.problems("k", {"a": 1}, "k[a=1]", rec)
        assert "k[a=1] declares" in problem and "launch.pdl: recorded False, declared True" in problem
        assert variant_abi.problems("k", {"a": 1}, "k[a=1]", ABI.to_json()) == []

    def unknown(k, p):
        raise ValueError("no such variant")
    with variant_abi.provider(unknown):
        assert "not one this musekern declares (no such variant)" in variant_abi.problems("k", {}, "k[]", rec)[0]


def test_import_musekern_registers_the_package_layers_provider():
    import subprocess
    import sys

    code = ("import musekern\nfrom musekern.store import variant_abi\np = variant_abi.get_provider()\n"
            "print(p is not None and p('qk_norm', {}) is None)")  # declares nothing until the merge wires it
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs the build extra (the kernels' abi_for)")
def test_the_real_kernels_declarations_pass_their_own_json_and_tell_siblings_apart(capsys):
    """Every planned variant's declared ABI survives the manifest's JSON (tuples become lists) with no difference,
    so the strict check has no false positive on a genuine build. And the figure for the report: how many planned
    variants share their ABI with a sibling (those only a signature tells apart)."""
    import json

    from musekern.config import load_config
    from musekern.plan import plan_model
    from musekern.targets import get_target

    groups: dict = {}
    for pe in plan_model(load_config(), [get_target("h200"), get_target("b200")]):
        declared = importlib.import_module(f"musekern.kernels.{pe.kernel}").abi_for(pe.variant).to_json()
        assert variant_abi.differences(declared, json.loads(json.dumps(declared))) == []
        key = json.dumps([pe.kernel, pe.arch,
                          [{k: v for k, v in p.items() if k != "doc"} for p in declared["params"]],
                          {k: v for k, v in declared["launch"].items() if k != "grid"}, declared["tensormaps"]],
                         sort_keys=True)
        groups.setdefault(key, []).append(pe.variant.label)
    shared = [g for g in groups.values() if len(g) > 1]
    with capsys.disabled():
        print(f"\n{sum(map(len, groups.values()))} planned variants, {len(groups)} distinct ABIs; "
              f"{sum(map(len, shared))} variants share theirs with a sibling")


@pytest.mark.slow
def test_the_issues_sibling_a_one_vector_epilogue_under_the_four_vector_key_is_refused_unsigned(tmp_path):
    """Issue 28's example: the vecs_per_thread=1 epilogue's cubin (the very same launch ABI as the 4-vector one, so
    the ABI check alone cannot tell them apart) under the 4-vector key would leave most of y unwritten. Its entry
    symbol carries its own variant's tag (store.keys.variant_tag), not the key's: refused with no signature asked."""
    from musekern.builder.compile import build_variant
    from musekern.kernels import declared_abi
    from musekern.kernels.qkv_epilogue.variant import QkvEpilogueVariant
    from musekern.store.cache import Cache
    from musekern.store.keys import key_parts, variant_tag

    one, four = QkvEpilogueVariant(vecs_per_thread=1), QkvEpilogueVariant(vecs_per_thread=4)
    built = build_variant(one, "sm_90a")
    parts = key_parts(four, "sm_90a", "4.8.1")
    same = [declared_abi(v.kernel, v.params()).to_json() for v in (one, four)]
    assert same[0] == same[1]  # one launch ABI: only the symbol tells the two builds apart
    assert variant_tag(one.kernel, one.params()) in built.manifest["symbol"]
    forged = {**built.manifest, "label": parts.label, "variant": parts.variant_params}
    with pytest.raises(ValueError, match="is not this variant's"):
        Cache(tmp_path / "c").put(parts, built.cubin, forged)
    own = key_parts(one, "sm_90a", "4.8.1")
    assert Cache(tmp_path / "d").put(own, built.cubin, built.manifest).key == own.key()
