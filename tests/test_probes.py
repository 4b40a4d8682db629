"""bench/probes: the GPU-free halves of the probes (their configs, and that they still build against the kernel).

The probes are bench scripts, run on the GPU machine from a build made here; the trace probe subclasses the
front's warp roles with their exact signatures, so a kernel change that breaks it must fail here, not on the
device.
"""
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[1] / "bench" / "probes"


def _probe(name):
    spec = importlib.util.spec_from_file_location(name, PROBES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_skeleton_probe_config_sets_are_valid_and_named_uniquely():
    sp = _probe("skeleton_probe")
    for configs in sp.CONFIG_SETS.values():
        names = [c.name for c in configs]
        assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="stash needs mode 'before'"):
        sp.ProbeConfig("x", 34, 2, 5, "after", "late", stash=2)
    with pytest.raises(ValueError, match="ahead needs trigger 'late'"):
        sp.ProbeConfig("x", 34, 2, 5, "before", "exit", ahead=4)
    with pytest.raises(ValueError, match="past the prefill"):
        sp.ProbeConfig("x", 34, 2, 5, "before", "late", stash=4, ahead=23)  # 31 - 5 - 4 = 22 at most


def test_tail_trace_cases_are_planned_variants_with_room_for_the_stamps():
    from musekern.kernels.qkv_front.variant import padded_tokens

    tt = _probe("tail_trace")
    for name, shape, overrides in tt.CASES:
        v = tt._variant(shape["n"], shape["m"], overrides)
        row = tt.trace_row(v)
        assert row == shape["m"]  # the probe runs with M = the first unwritten row
        # rows M..TT-1 of y hold every CTA's stamps
        assert (padded_tokens(v) - row) * v.n * 2 >= v.heads * v.k_split * tt.SLOTS * 8, name


@pytest.mark.slow
# (one tile "rows", two tiles "k", and the wgmma build of TP4 at 57 tokens)
@pytest.mark.parametrize("case", [0, 2, 14], ids=["one-tile-rows", "two-tile-k", "eight-tile-wg"])
def test_tail_trace_builds_against_the_kernel(case):
    """The traced subclass compiles with the kernel's ABI (compile_variant checks the PTX .entry) and stamps
    at its 8 sites: producer start / end, aux after the wait, consumer done (warps 0 and 3), sent, partials
    landed, epilogue done; at the kernel's entry; and past ring_idle, once per role that calls it (producer and aux;
    the consumers too in the wgmma builds)."""
    pytest.importorskip("cutlass")
    tt = _probe("tail_trace")
    name, shape, overrides = tt.CASES[case]
    v = tt._variant(shape["n"], shape["m"], overrides)
    ck = tt.compile_traced(v)
    stamps = 9 + 2 + (v.warp_split == "wg")
    assert len(re.findall(r"mov\.u64\s+%rd\d+, %globaltimer;", ck.ptx)) == stamps
    assert len(re.findall(r"mov\.u64\s+%rd\d+, %clock64;", ck.ptx)) == stamps
    assert len(re.findall(r"mov\.u32\s+%r\d+, %smid;", ck.ptx)) == 1


def test_tail_trace_predecessor_keeps_the_bench_kernel_and_builds():
    """The trace's predecessor is the bench's RMSNorm source plus three globaltimer stamps (its edits assert
    that each anchor occurs once in the source, so a change of the bench kernel fails here) and still builds."""
    from bench.harness import pred

    tt = _probe("tail_trace")
    src = tt.traced_pred_source()
    assert src.count("%%globaltimer") == 3 and src.count("griddepcontrol.") == 2
    assert src.startswith(pred.SOURCE.split("extern")[0])  # the bench kernel's helpers, untouched
    try:
        cubin, _ = pred.compile_cubin("sm_90a", src, "pred_traced.cu")
    except RuntimeError as e:
        pytest.skip(f"neither NVRTC nor nvcc here: {e}")
    assert cubin[:4] == b"\x7fELF" and pred.SYMBOL.encode() in cubin


def test_w8_alts_split4_builds_are_tp8_e4m3_fronts_at_k_split_4_serving_m_1_to_16():
    # the probe's builds replace the planned TP8 e4m3 ones in w8_bench.timing's table: every M 1..16, both scale kinds
    alts = _probe("w8_alts")
    table = alts.table("split4")
    assert {(k[2], k[3]) for k in table} == {(kind, m) for kind in alts.KINDS for m in range(1, 17)}
    for (n, wd, kind, _), v in table.items():
        assert (n, v.n, v.k_split, v.tiles, v.weight_dtype, v.weight_scale) == (alts.N, alts.N, 4, 2, wd, kind)
        assert v.n // 64 * v.k_split == 136  # 34 heads x 4: every SM of an H100 / H200 holds one CTA or two


# the one-tile e4m3 builds (M = 1..8) of TP8 and TP2: "rows1" / "rows1tp2" are the plan's builds with "rows" for its
# "k" (TP8 M <= 7: for its "wg", the W8A8 build), nothing else moved; "k1" / "k1tp2" are the W8A16 "k" builds
@pytest.mark.parametrize("alt,k_alt,n", [("rows1", "k1", 2176), ("rows1tp2", "k1tp2", 8704)])
def test_w8_alts_rows1_differs_from_the_plan_only_in_warp_split(alt, k_alt, n):
    from musekern.kernels.qkv_front import rules
    from musekern.targets import get_target

    alts = _probe("w8_alts")
    table = alts.table(alt)
    assert {(k[0], k[2], k[3]) for k in table} == {(n, kind, m) for kind in alts.KINDS for m in range(1, 9)}
    nkv = alts.ALTS[alt][4][1]
    for (_, _, kind, m), v in table.items():
        planned = rules.variant(n, m, nkv, get_target("h200"), weight_dtype="fp8_e4m3", weight_scale=kind)
        w8a8 = n == alts.N and m < 8  # TP8's runtime-M one-tile build is W8A8 ("wg"): "k1" its W8A16 twin
        assert (planned.warp_split, v.warp_split) == ("wg" if w8a8 else "k", "rows")
        twin = dataclasses.replace(planned, x_dtype="bf16", fixed_rows=rules.fixed_rows(m)) if w8a8 else planned
        assert dataclasses.replace(v, warp_split="k") == dataclasses.replace(twin, warp_split="k") == alts.table(
            k_alt)[(n, "fp8_e4m3", kind, m)]
        if n == alts.N:
            assert alts.table("plan")[(n, "fp8_e4m3", kind, m)] == planned  # "plan": the planned builds themselves


def test_ptx_dump_lists_every_planned_build_once():
    """bench/probes/ptx_dump.py (the PTX-identity check of a kernel refactor): each plan's builds are in its list, the
    labels parse, and each names a distinct file."""
    from musekern.config import load_config, with_weight_format
    from musekern.plan import plan_model, variant_from_label
    from musekern.targets import get_target

    pd = _probe("ptx_dump")
    got = pd.labels()
    model = with_weight_format(load_config(), "fp8-channel")
    planned = {e.variant.label for e in plan_model(model, [get_target("h200")])}
    assert planned <= set(got) and pd.extra() <= set(got) and len(got) == len(set(got))
    assert all(variant_from_label(lbl).label == lbl for lbl in got)
