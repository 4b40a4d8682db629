"""x_quant (kernels/x_quant, issue 30): CPU checks of the one build: the ABI record against the PTX .entry, the
instructions the contract rests on (16-byte loads, the row's amax by shuffles, a correctly rounded amax / 448, the
satfinite e4m3 conversions of the true quotient, 8-byte stores), no local memory; and the plan takes it exactly for
FP8 checkpoints with per-row scales (the W8A8 GEMM path)."""
from __future__ import annotations

import re

import pytest

from musekern.kernels.x_quant.abi import abi_for
from musekern.kernels.x_quant.variant import XQ_BLOCK, XQ_SMEM_BYTES, XQ_VECS, XQuantVariant


def test_abi_record():
    abi = abi_for(XQuantVariant())
    assert [p.name for p in abi.params] == ["x", "q", "scale", "ld_x"]
    assert abi.launch.block == (XQ_BLOCK, 1, 1) and abi.launch.dynamic_smem_bytes == XQ_SMEM_BYTES
    assert not abi.launch.pdl and abi.tensormaps == ()
    assert XQuantVariant().label == "x_quant[]"


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("cutlass")
    from musekern.builder.compile import compile_variant

    return compile_variant(XQuantVariant(), "sm_90a")


def test_ptx(compiled):
    from musekern.store.abi import check_abi_against_ptx

    check_abi_against_ptx(compiled.abi, compiled.ptx, compiled.symbol)
    ptx = compiled.ptx
    assert len(re.findall(r"ld\.global(\.nc)?\.v4\.(b32|u32)", ptx)) == XQ_VECS
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == 5 and "div.rn.f32" in ptx
    # each vector's 8 bytes twice: the power-of-two scale's products and any other scale's quotients (fp8.py)
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == 2 * 4 * XQ_VECS
    assert len(re.findall(r"st\.global\.v2\.b32", ptx)) == 2 * XQ_VECS
    assert not re.search(r"div\.(approx|full)\.f32|\batom\.|(?<![\w.])red\.", ptx)


def test_sass(compiled, tmp_path):
    import nvdump

    usage = nvdump.resources(compiled.cubin, tmp_path)
    if usage is None:
        pytest.skip("cuobjdump not installed")
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0


# the formats whose GEMM path is W8A8 take it (per-channel, per-tensor); bf16 and block checkpoints do not
@pytest.mark.parametrize("fmt,planned", [("bf16", False), ("fp8-channel", True), ("fp8-tensor", True),
                                         ("fp8-block", False)])
def test_planned_for_fp8_per_row_scales(fmt, planned):
    from musekern.config import load_config, with_weight_format
    from musekern.plan import plan_model
    from musekern.targets import get_target

    model = with_weight_format(load_config(), fmt)
    kinds = {e.kernel for e in plan_model(model, [get_target("h200")])}
    assert ("x_quant" in kinds) == planned
