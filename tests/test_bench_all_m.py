"""bench/harness/all_m.py: the all-M table's row math, targets, cliffs and text (pure: no GPU)."""
import pytest

from bench.harness import all_m

COPY = 4.0  # TB/s


def _us(**kw):
    base = {"musekern": 10.0, "cublas": 15.0, "unfused": 50.0, "gemm_epilogue": 16.0, "epilogue": 1.2}
    return {**base, **kw}


# one row per regime the targets distinguish: small M at TP8 / TP4 (path < cuBLAS, >= 3x unfused, epilogue
# <= 2.5 us), the band 65..1023 (no target), prefill (epilogue bandwidth, GEMM + epilogue <= 1.10x cuBLAS),
# TP1 at small M (only the epilogue's time)
@pytest.mark.parametrize("tp,m,names", [
    (8, 1, {"epilogue_us", "x_cublas", "vs_unfused"}), (4, 64, {"epilogue_us", "x_cublas", "vs_unfused"}),
    (8, 128, set()), (8, 4096, {"epilogue_frac", "gemm_epilogue_x_cublas"}), (1, 17, {"epilogue_us"})])
def test_targets_apply_where_the_issue_sets_them(tp, m, names):
    n, nkv = {8: (2176, 1), 4: (4352, 2), 1: (17408, 8)}[tp]
    r = all_m.row(tp, n, nkv, m, _us(), "front", COPY)
    assert {c["name"] for c in r["checks"]} == names
    assert r["status"] == ("-" if not names else r["status"])


def test_row_math():
    r = all_m.row(8, 2176, 1, 4096, _us(musekern=200.0, cublas=190.0, gemm_epilogue=200.0, epilogue=6.0,
                                         unfused=420.0, gemm_best=180.0), "gemm", COPY)
    assert r["x_cublas"] == pytest.approx(200 / 190) and r["speedup_vs_unfused"] == pytest.approx(2.1)
    assert r["x_gemm_best"] == pytest.approx(200 / 180)  # against the tuned GEMM alone: recorded, no target
    # the epilogue's bytes (variants.qkv_epilogue.epilogue_bytes): 5008 B a token at TP8 (NOTES "qkv_epilogue")
    assert r["epilogue_bytes"] == 5008 * 4096
    assert r["epilogue_frac_of_copy_bw"] == pytest.approx(5008 * 4096 / 6e-6 / 1e12 / COPY)
    checks = {c["name"]: c["pass"] for c in r["checks"]}
    assert checks == {"epilogue_frac": True, "gemm_epilogue_x_cublas": True}
    assert r["epilogue_frac_of_same_bytes_copy"] is None  # no copy timed: no verdict on it


# the epilogue against the 2 GiB copy measured right before its row (the device drifts over a run): TP8 M = 1024
# moves 5008 x 1024 bytes
@pytest.mark.parametrize("here", [3.8, 4.3])
def test_epilogue_against_the_copy_measured_before_its_row(here):
    r = all_m.row(8, 2176, 1, 1024, _us(epilogue=1.5), "gemm", COPY, here)
    assert r["copy_TBps_here"] == here
    assert r["epilogue_frac_of_copy_bw_here"] == pytest.approx(5008 * 1024 / 1.5e-6 / 1e12 / here)
    checks = {c["name"]: c["pass"] for c in r["checks"]}
    assert checks["epilogue_frac_here"] is (r["epilogue_frac_of_copy_bw_here"] >= 0.85)
    assert all_m.row(8, 2176, 1, 1024, _us(), "gemm", COPY)["epilogue_frac_of_copy_bw_here"] is None


# the epilogue against a copy of its own bytes in the same samples: copy time / epilogue time, >= 0.85 to pass
@pytest.mark.parametrize("copy_us,ok", [(5.4, True), (5.1, True), (4.8, False)])
def test_epilogue_against_a_copy_of_its_bytes(copy_us, ok):
    r = all_m.row(8, 2176, 1, 1024, _us(epilogue=6.0, copy=copy_us), "gemm", COPY)
    assert r["epilogue_frac_of_same_bytes_copy"] == pytest.approx(copy_us / 6.0)
    checks = {c["name"]: c["pass"] for c in r["checks"]}
    assert checks["epilogue_frac_same_bytes_copy"] is ok


def test_a_missing_measurement_is_not_a_pass():
    r = all_m.row(8, 2176, 1, 16, {"cublas": 15.0}, "front", COPY)
    assert r["status"] != "PASS" and all(c["pass"] is None for c in r["checks"])


def test_cliffs_compare_the_jump_with_the_bytes():
    rows = [all_m.row(8, 2176, 1, m, _us(musekern=t), p, COPY)
            for m, t, p in ((16, 10.0, "front"), (17, 10.2, "front"), (32, 10.5, "front"), (33, 16.5, "gemm"))]
    got = {(c["from"], c["to"]): c for c in all_m.cliffs(rows, COPY)}
    assert got[(16, 17)]["pass"] and not got[(32, 33)]["pass"] and got[(32, 33)]["paths"] == ["front", "gemm"]
    assert got[(16, 17)]["bytes_explain_us"] == pytest.approx((8192 * 2 + 2176 * 2) / (COPY * 1e12) * 1e6)
    assert (64, 65) not in got  # not measured: no verdict


def test_table_has_a_line_per_row_and_per_step():
    rows = [all_m.row(8, 2176, 1, m, _us(), "front", COPY) for m in (16, 17)]
    rows[1]["error"] = "output check: NaN"
    text = all_m.format_all_m({"all_m": rows, "all_m_cliffs": all_m.cliffs(rows, COPY)})
    lines = text.splitlines()
    assert len(lines) == 3 + 2 + 1 and "ERROR output check" in lines[4] and lines[-1].startswith("step TP8 M 16->17")
    assert "bestGEMM" in lines[1]  # the tuned cuBLAS GEMM's column beside torch.mm's
    assert all_m.format_all_m({}) == ""


def test_the_grid_covers_the_rules_edges():
    """Every M where a timed shard's build or path changes (H200) is a CLIFF_PAIRS step of the grid."""
    from musekern.config import FRONT_MAX_TOKENS, load_config
    from musekern.kernels.qkv_front.rules import front_serves, variant
    from musekern.targets import get_target

    assert {16, 17, FRONT_MAX_TOKENS, FRONT_MAX_TOKENS + 1, 64, 65, 16384} <= set(all_m.ALL_M)
    assert all((a in all_m.ALL_M and b in all_m.ALL_M) for a, b in all_m.CLIFF_PAIRS)
    t, model = get_target("h200"), load_config()

    def build(s, m):
        if not front_serves(s.n, m, t):
            return "gemm"
        v = variant(s.n, m, s.num_kv_heads, t)
        return v.tiles, v.k_split

    for tp in all_m.ALL_M_TPS:
        s = model.shard(tp)
        edges = {(m, m + 1) for m in range(16, FRONT_MAX_TOKENS + 1) if build(s, m) != build(s, m + 1)}
        assert edges <= set(all_m.CLIFF_PAIRS), (tp, sorted(edges - set(all_m.CLIFF_PAIRS)))
