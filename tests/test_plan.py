"""musekern/plan.py: the kernel registry and what a variant's kernel declares for its launch (`declared_abi`).

The planner's rules themselves are tested in tests/test_variants.py (per kernel: tests/test_variants_*.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from musekern.config import load_config
from musekern.kernels.qk_norm.variant import QkNormVariant
from musekern.plan import REGISTRY, declared_abi, kernel_spec, plan_model, variant_of
from musekern.store.abi import KernelAbi
from musekern.targets import get_target

# every build the h200 plan of the bundled model takes (all three kernels; the front's 1-8 tile builds, the M == 8
# build, each PDL trigger and warp split, x_mcast, recv_in_ring): the set the store-side check will meet
PLANNED = [e.variant for e in plan_model(load_config(), [get_target("h200")])]


def test_registry_lists_each_kernel_once_under_its_name():
    assert list(REGISTRY) == ["qk_norm", "qkv_front", "qkv_epilogue", "x_quant"]
    assert all(spec.variant.kernel == name for name, spec in REGISTRY.items())
    assert {v.kernel for v in PLANNED} == set(REGISTRY) - {"x_quant"}  # (x_quant: FP8 checkpoints' plans only)


@pytest.mark.parametrize("v", PLANNED, ids=lambda v: v.label)
def test_declared_abi_from_a_manifests_kernel_and_params(v):
    """What a manifest names (kernel, params as JSON: fields at their default left out) gives the variant back, and
    declared_abi gives that kernel's own ABI record of it, equal after a JSON round trip (what a manifest holds)."""
    params = json.loads(json.dumps(v.params()))
    assert variant_of(v.kernel, params) == v
    abi = declared_abi(v.kernel, params)
    assert abi == kernel_spec(v.kernel).abi(v)
    assert KernelAbi.from_json(json.loads(json.dumps(abi.to_json()))) == abi


# an FP8 checkpoint's plan (issue 30): every front build of each granularity, as a manifest names it, gives the
# variant back and its ABI (the scale's address where bf16 builds take weight_ptr, the weight's map u8); its keys and
# labels name the weight, the bf16 plan's name none (existing keys do not move)
def _fp8_planned(fmt: str) -> list:
    from musekern.config import with_weight_format

    model = with_weight_format(load_config(), fmt)
    return [e.variant for e in plan_model(model, [get_target("h200")]) if e.kernel == "qkv_front"]


@pytest.mark.parametrize("v", _fp8_planned("fp8-channel") + _fp8_planned("fp8-block"), ids=lambda v: v.label)
def test_fp8_weight_plan_declares_its_abi(v):
    assert v.weight_dtype == "fp8_e4m3" and f"weight_scale={v.weight_scale}" in v.label
    params = json.loads(json.dumps(v.params()))
    assert variant_of(v.kernel, params) == v
    abi = declared_abi(v.kernel, params)
    names = [p.name for p in abi.params]
    assert "weight_scale" in names and "weight_ptr" not in names
    assert {(m.param, m.dtype) for m in abi.tensormaps} >= {("tma_w", "u8")}


def test_bf16_plan_names_no_weight_fields():
    assert all("weight_" not in v.label for v in PLANNED)
    assert all("weight_dtype" not in v.params() and "weight_scale" not in v.params() for v in PLANNED)


@pytest.mark.parametrize("kernel,params,match", [
    ("flash_attn", {}, "unknown kernel 'flash_attn'; known: qk_norm, qkv_front, qkv_epilogue"),
    ("qk_norm", {"dtype": "bfloat16", "head_dim": 64}, "has_scale"),  # a required field missing
    ("qk_norm", {"dtype": "bfloat16", "head_dim": 64, "has_scale": True, "bogus": 1}, "no parameter.*bogus"),
    ("qk_norm", {"dtype": "int8", "head_dim": 64, "has_scale": True}, "does not support dtype=int8"),
    ("qkv_front", {"n": 2176, "num_kv_heads": 1, "tiles": 1, "stages": 6, "k_split": 3, "fixed_rows": 0},
     "k_split must be one of"),
    ("qkv_epilogue", ["vecs_per_thread", 1], "must be an object"),
])
def test_declared_abi_refuses_what_no_kernel_declares(kernel, params, match):
    """A forged or stale manifest's (kernel, params): a ValueError naming the problem, never another kernel's ABI."""
    with pytest.raises(ValueError, match=match):
        declared_abi(kernel, params)


def test_declared_abi_needs_no_cutlass_and_no_gpu():
    """In a fresh process (this session may have imported cutlass for the compile tests): the store side of a
    serving image calls it."""
    code = ("import sys, musekern.plan as p; p.declared_abi('qkv_epilogue', {'vecs_per_thread': 2}); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cutlass', 'torch')"
            " or m.startswith('musekern.builder') or m.endswith('.kernel')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# the real build's manifest: one build of each kernel, and the front's M == 8 build (no x_coord parameter) and a
# cluster-of-8 x_mcast wgmma build (the largest launch configuration the plan takes)
SAMPLE = [QkNormVariant("bfloat16", 64, True), next(v for v in PLANNED if v.kernel == "qkv_epilogue"),
          next(v for v in PLANNED if v.kernel == "qkv_front" and v.fixed_rows),
          max((v for v in PLANNED if v.kernel == "qkv_front"), key=lambda v: (v.x_mcast, v.k_split, v.tiles))]


@pytest.mark.slow
@pytest.mark.parametrize("v", SAMPLE, ids=lambda v: v.label)
def test_declared_abi_is_what_the_build_writes_into_its_manifest(v):
    pytest.importorskip("cutlass")
    from musekern.builder.compile import build_variant

    manifest = build_variant(v, "sm_90a").manifest
    assert manifest["abi"] == declared_abi(manifest["kernel"], manifest["variant"]).to_json()
