"""x_quant (kernels/x_quant, issue 30): CPU checks of its two builds (per token, per 128-column group): the ABI record
against the PTX .entry, the instructions the contract rests on (16-byte loads, the amax by shuffles, correctly rounded
divisions by 448, the satfinite e4m3 conversions of the true quotient, 8-byte stores), no local memory; and the plan
takes the build each FP8 checkpoint's W8A8 GEMM path needs."""
from __future__ import annotations

import re

import pytest

from musekern.kernels.x_quant.abi import abi_for
from musekern.kernels.x_quant.variant import XQ_BLOCK, XQ_GROUP, XQ_SMEM_BYTES, XQ_VECS, XQuantVariant

GROUPS = [0, XQ_GROUP]  # the two builds


def test_abi_record():
    abi = abi_for(XQuantVariant())
    assert [p.name for p in abi.params] == ["x", "q", "scale", "ld_x", "m"]
    assert abi.launch.block == (XQ_BLOCK, 1, 1) and abi.launch.dynamic_smem_bytes == XQ_SMEM_BYTES
    assert abi.launch.pdl and abi.tensormaps == ()  # launched with PDL: a front after it prefetches meanwhile
    assert XQuantVariant().label == "x_quant[]" and XQuantVariant(group=XQ_GROUP).label == "x_quant[group=128]"
    with pytest.raises(ValueError, match="group must be 0"):
        XQuantVariant(group=64)


@pytest.fixture(scope="module", params=GROUPS)
def compiled(request):
    pytest.importorskip("cutlass")
    from musekern.builder.compile import compile_variant

    return request.param, compile_variant(XQuantVariant(group=request.param), "sm_90a")


def test_ptx(compiled):
    from musekern.store.abi import check_abi_against_ptx

    group, c = compiled
    check_abi_against_ptx(c.abi, c.ptx, c.symbol)
    ptx = c.ptx
    assert len(re.findall(r"ld\.global(\.nc)?\.v4\.(b32|u32)", ptx)) == XQ_VECS
    # per token: the warp's 5 shuffles, one amax / 448, the warps' maxima through shared memory; per group: each
    # vector's half-warp max (4 shuffles) and its own scale, no shared memory, no barrier
    shuffles, divisions = (4 * XQ_VECS, XQ_VECS) if group else (5, 1)
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == shuffles and ptx.count("div.rn.f32") == divisions
    assert bool(re.search(r"\bbar\.sync|barrier\.sync|st\.shared", ptx)) == (not group)
    # each vector's 8 bytes twice: the power-of-two scale's products and any other scale's quotients (fp8.py)
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == 2 * 4 * XQ_VECS
    assert len(re.findall(r"st\.global\.v2\.b32", ptx)) == 2 * XQ_VECS
    assert len(re.findall(r"st\.global\.b32", ptx)) == (XQ_VECS if group else 1)  # the scales
    assert not re.search(r"div\.(approx|full)\.f32|\batom\.|(?<![\w.])red\.", ptx)
    # PDL: let the next grid launch, then wait for the previous grid before the first load of x
    wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= trigger < wait < re.search(r"ld\.global", ptx).start()


def test_sass(compiled, tmp_path):
    import nvdump

    usage = nvdump.resources(compiled[1].cubin, tmp_path)
    if usage is None:
        pytest.skip("cuobjdump not installed")
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0


# every weight format: per-row scales (per-channel, per-tensor) take the per-token build for the GEMM path and the group
# build for TP8's W8A8 front (x quantized ahead of it), block ones the group build, bf16 neither
@pytest.mark.parametrize("fmt,planned", [("bf16", []), ("fp8-channel", [0, XQ_GROUP]), ("fp8-tensor", [0, XQ_GROUP]),
                                         ("fp8-block", [XQ_GROUP]), ("fp8-block-ue8m0", [XQ_GROUP])])
def test_planned_for_each_weight_format(fmt, planned):
    from musekern.config import load_config, with_weight_format
    from musekern.plan import plan_model
    from musekern.targets import get_target

    model = with_weight_format(load_config(), fmt)
    entries = [e for e in plan_model(model, [get_target("h200")]) if e.kernel == "x_quant"]
    assert [e.variant.group for e in entries] == planned
