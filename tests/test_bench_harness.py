"""CPU tests of the bench harness's pure parts (bench/harness/, outside the wheel): row math, targets, JSON schema,
table, the unfused epilogue against musekern.reference, the plot writer, and its command's help and no-GPU error."""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from bench.harness import report
from bench.harness.timing import loops_for
from bench.harness.unfused import unfused_epilogue
from musekern.reference import fused_qknorm_rope_kv_insert

COPY = 4.0  # TB/s
ROOT = Path(__file__).resolve().parents[1]


def pair(n=2176, m=1, tp=8, **us):
    base = {"chain": 9.0, "after_norm_total": 10.5, "pred_only": 1.6, "isolated": 11.0, "cublas": 14.4,
            "unfused": 40.0}
    base.update(us)
    return {"N": n, "M": m, "tp": tp, "num_kv_heads": 1, "us": base}


def test_floor_frac_and_speedups():
    fl = report.floor_us(2176, COPY)
    assert fl == pytest.approx(2176 * 8192 * 2 / 4e12 * 1e6)
    rows = {r["mode"]: r for r in report.make_rows(pair(), COPY)}
    assert set(rows) == {"chain", "after-norm", "isolated", "cublas", "unfused"}
    c = rows["chain"]
    assert c["frac_of_copy_bw"] == pytest.approx(fl / 9.0)
    assert c["tbps"] == pytest.approx(2176 * 8192 * 2 / 9e-6 / 1e12)
    assert c["speedup_vs_cublas"] == pytest.approx(14.4 / 9.0)
    assert c["speedup_vs_unfused"] == pytest.approx(40.0 / 9.0)
    a = rows["after-norm"]
    assert a["us"] == pytest.approx(10.5 - 1.6) and a["total_us"] == 10.5 and a["pred_us"] == 1.6
    assert rows["cublas"]["frac_of_copy_bw"] == pytest.approx(fl / 14.4)


def test_targets_pass_and_miss():
    fl = report.floor_us(2176, COPY)  # 8.91 us at 4 TB/s
    good = {r["mode"]: r for r in report.make_rows(pair(chain=fl / 0.95), COPY)}
    report.add_m16_checks(list(good.values()))
    assert good["chain"]["status"] == "PASS"
    assert good["after-norm"]["status"] == "PASS"  # 8.9 <= 9.0
    bad = {r["mode"]: r for r in report.make_rows(pair(chain=fl / 0.80, isolated=fl / 0.5, after_norm_total=12.0),
                                                  COPY)}
    report.add_m16_checks(list(bad.values()))
    assert bad["chain"]["status"] == "MISS"
    assert [c["name"] for c in bad["chain"]["checks"] if not c["pass"]] == ["frac_of_copy_bw", "speedup_vs_cublas",
                                                                           "speedup_vs_unfused"]
    assert bad["isolated"]["status"] == "MISS" and bad["after-norm"]["status"] == "MISS"
    assert bad["cublas"]["status"] == "-"


def test_tp1_added_time_is_relative_to_the_floor():
    n = 17408
    fl = report.floor_us(n, COPY)
    rows = {r["mode"]: r for r in report.make_rows(pair(n=n, tp=1, after_norm_total=fl + 1.0, pred_only=1.0), COPY)}
    chk = rows["after-norm"]["checks"][0]
    assert chk["target"] == pytest.approx(fl) and chk["pass"] is True


def test_m16_within_10_percent_of_m1():
    rows = report.make_rows(pair(m=1, chain=9.0), COPY) + report.make_rows(pair(m=16, chain=10.0), COPY)
    report.add_m16_checks(rows)
    r16 = next(r for r in rows if r["M"] == 16 and r["mode"] == "chain")
    c = next(c for c in r16["checks"] if c["name"] == "m16_over_m1")
    assert c["value"] == pytest.approx(10 / 9) and c["pass"] is False


def test_missing_measurement_is_not_a_number():
    p = pair()
    p["us"] = {}
    p["error"] = "boom"
    rows = report.make_rows(p, COPY)
    report.add_m16_checks(rows)
    assert all(r["us"] is None and r["status"] == "-" for r in rows)
    assert {r["mode"] for r in rows} == set(report.FRONT_MODES)


def test_output_check_failure_marks_fail():
    p = pair()
    p["output_checks"] = {"chain": {"ok": False, "bad_layers": [3]}}
    rows = report.make_rows(p, COPY)
    report.add_m16_checks(rows)
    assert next(r for r in rows if r["mode"] == "chain")["status"] == "FAIL"


def test_qk_norm_row():
    r = report.qk_norm_row(64, 4096, 8192, 40.0, COPY)
    assert r["bytes"] == 2 * 4096 * 8192 * 2
    assert r["frac_of_copy_bw"] == pytest.approx(r["bytes"] / 40e-6 / 1e12 / COPY)
    assert r["status"] == "PASS"
    assert report.qk_norm_row(64, 16, 8192, 2.0, COPY)["status"] == "MISS"
    assert report.qk_norm_row(64, 256, 8192, 2.0, COPY)["status"] == "-"


def test_host_checks():
    h = report.host_checks({"launch_us": 5.0, "qkv_front_us": 25.0, "first_call": {"first_call_ms": 30.0}})
    assert h["status"] == "MISS" and [c["pass"] for c in h["checks"]] == [True, False, True]
    assert report.host_checks({})["status"] == "-"


def _doc():
    rows = []
    for n, tp in ((2176, 8), (4352, 4)):
        for m in (1, 16):
            rows += report.make_rows(pair(n=n, tp=tp, m=m), COPY)
    report.add_m16_checks(rows)
    qk = [report.qk_norm_row(64, 4096, 8192, 40.0, COPY)]
    meta = {"commit": "abc", "device": "NVIDIA H200", "driver": 13000, "torch": "2.11", "cuda_bindings": "13.0",
            "wall_s": 12.0}
    return report.make_doc(meta, COPY, rows, qk, {"launch_us": 4.0, "qkv_front_us": 9.0,
                                                   "first_call": {"first_call_ms": 20.0}})


def test_json_schema(tmp_path):
    doc = _doc()
    assert list(doc)[:len(report.DOC_KEYS)] == list(report.DOC_KEYS)
    p = report.write_json(doc, str(tmp_path))
    back = json.loads(open(p).read())
    assert back["targets"]["qkv_front"]["tp8"]["chain_frac"] == 0.90
    for r in back["rows"]:
        for k in ("N", "M", "mode", "us", "frac_of_copy_bw", "speedup_vs_cublas", "speedup_vs_unfused", "status"):
            assert k in r
    assert back["host"]["status"] == "PASS" and back["wall_s"] == 12.0


def test_table_format():
    t = report.format_table(_doc())
    lines = t.splitlines()
    assert "copy 4.000 TB/s" in lines[0]
    assert sum(" chain " in ln for ln in lines) == 4
    assert any("PASS" in ln for ln in lines) and lines[-1].startswith("summary:")
    assert any(ln.startswith("qk_norm") for ln in lines) and any(ln.startswith("host:") for ln in lines)


def test_table_shows_the_launch_floor_next_to_qk_norm_m16():
    doc = _doc()
    doc["qk_norm"] = [dict(report.qk_norm_row(64, 16, 4096, 1.7, COPY), launch_floor_us=1.52)]
    line = [ln for ln in report.format_table(doc).splitlines() if "M     16" in ln][0]
    assert "1.70 us" in line and "launch floor 1.52 us" in line


def test_empty_kernel_and_predecessor_build_here():
    """The bench's NVRTC / nvcc builds (the after-norm predecessor and the launch-floor kernel) need no GPU."""
    from bench.harness import pred

    try:
        cubins = [pred.compile_cubin("sm_90a")[0], pred.compile_cubin("sm_90a", pred.EMPTY_SOURCE, "e.cu")[0]]
    except RuntimeError as e:
        pytest.skip(f"neither NVRTC nor nvcc here: {e}")
    for cubin, symbol in zip(cubins, (pred.SYMBOL, pred.EMPTY_SYMBOL), strict=True):
        assert cubin[:4] == b"\x7fELF" and symbol.encode() in cubin


def test_commit_info_reads_build_info(tmp_path):
    (tmp_path / "BUILD_INFO.json").write_text(json.dumps({"commit": "deadbeef", "dirty": False}))
    assert report.commit_info(cache_dir=str(tmp_path))["commit"] == "deadbeef"


def test_git_state_of_a_tree_and_of_no_repository(tmp_path):
    import re
    from pathlib import Path

    here = report.git_state(str(Path(__file__).resolve().parents[1]))
    assert re.fullmatch(r"[0-9a-f]{40}", here["commit"]) and isinstance(here["dirty"], bool)
    assert report.git_state(str(tmp_path)) == {"commit": None, "dirty": None}


def test_loops_for():
    assert loops_for(70e-6) == 22  # TP8: 8 layers x ~8.7 us
    assert loops_for(1e-2) == 1
    assert loops_for(1e-9) == loops_for(0) == 48


@pytest.mark.parametrize("nkv,m", [(1, 1), (2, 9), (8, 16)])
def test_unfused_epilogue_equals_reference(nkv, m):
    g = torch.Generator().manual_seed(nkv * 100 + m)
    nq = 2 * nkv
    n = (2 * nq + 2 * nkv) * 64
    y = torch.randn(m, n, generator=g).to(torch.bfloat16)
    max_pos = 64
    cs = torch.randn(max_pos, 64, generator=g)
    pos = torch.randint(-5, max_pos + 5, (m,), generator=g)  # clamped by both
    nb, bs = 8, 4
    slots = torch.randperm(nb * bs, generator=g)[:m]
    kv_a = torch.randn(2, nb, bs, nkv, 64, generator=g).to(torch.bfloat16)
    kv_b = kv_a.clone()
    ref = fused_qknorm_rope_kv_insert(y, pos, cs, slots, kv_a[0], kv_a[1], nkv, 1e-6)
    got = unfused_epilogue(y, pos, cs, slots, kv_b[0], kv_b[1], nkv, 1e-6)
    assert torch.equal(got, ref)
    assert torch.equal(kv_a, kv_b)


def test_plot_writer(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.harness.plot import write_plot

    p = write_plot(_doc(), str(tmp_path))
    assert p and (tmp_path / "qkv_front_roofline.png").stat().st_size > 1000


def test_plot_without_matplotlib_warns(tmp_path, monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    from bench.harness.plot import write_plot

    assert write_plot(_doc(), str(tmp_path)) is None
    assert "matplotlib" in capsys.readouterr().err


def _command():
    from bench.harness.__main__ import bench_cmd

    return bench_cmd


def test_cli_help():
    r = CliRunner().invoke(_command(), ["--help"])
    assert r.exit_code == 0
    for opt in ("--quick", "--json", "--out", "--modes", "--tp", "--m"):
        assert opt in r.output


def test_cli_without_gpu_exits_1(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(_command(), ["--quick"])
    assert r.exit_code == 1
    assert "the bench harness needs a CUDA GPU" in r.output


def test_cli_bad_mode_is_a_usage_error():
    r = CliRunner().invoke(_command(), ["--modes", "chain,warp"])
    assert r.exit_code == 2 and "unknown mode" in r.output


def test_bench_package_imports_no_cutlass_and_no_gpu():
    """In a fresh process: this test session may already have imported cutlass for the compile tests."""
    import subprocess
    import sys

    code = ("import sys, bench.harness.qk_norm, bench.harness.qkv_front, bench.harness.runner; "
            "assert 'cutlass' not in sys.modules, sorted(m for m in sys.modules if m.startswith('cutlass'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)  # bench.harness: from the repository root


def test_first_call_script_parses_and_inputs_match_the_ops_signature():
    import ast
    import inspect

    from bench.harness import host
    from musekern.ops import qkv_front as ops

    ast.parse(host.FIRST_CALL_SRC)
    src = inspect.getsource(host._inputs)
    keys = [k for k in list(inspect.signature(ops.launch).parameters) if f"{k}=" in src]
    order = sorted(keys, key=lambda k: src.index(f"{k}="))
    assert order == list(inspect.signature(ops.launch).parameters)


def _sweep_module(name="sweep_variants"):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sanitizer_launches_every_planned_front_build():
    """bench/sanitize_qkv_front.py's M values reach every planned qkv_front build of every shard, each at the smallest
    and the largest M it serves (a fixed M list once missed the builds a rule change added)."""
    from musekern.config import load_config
    from musekern.kernels.qkv_front.rules import front_serves, qkv_front_variants, variant
    from musekern.kernels.qkv_front.variant import FRONT_MAX_TOKENS
    from musekern.targets import get_target

    san, t = _sweep_module("sanitize_qkv_front"), get_target("h200")
    for s in load_config().shards():
        ms = san.planned_ms(s.n, s.num_kv_heads, t)
        assert all(front_serves(s.n, m, t) for m in ms)
        built = {variant(s.n, m, s.num_kv_heads, t) for m in ms}
        assert built == set(qkv_front_variants(s.n, s.num_kv_heads, t, FRONT_MAX_TOKENS)), s.tp
        assert 1 in ms and 16 in ms and (s.tp == 1 or 17 in ms)


def test_sweep_merges_repeats_into_medians_and_keeps_every_sample():
    sv = _sweep_module()
    runs = [{"label": "x", "M": 1, "chain_us": c, "chain_frac": 0.7, "isolated_us": i, "isolated_frac": 0.6}
            for c, i in ((11.0, 12.0), (13.9, 12.2), (11.2, 12.1))]
    row = sv.merge_repeats(runs + [{"label": "x", "M": 1, "error": "RuntimeError: boom"}])
    assert (row["chain_us"], row["isolated_us"]) == (11.2, 12.1)
    assert row["samples"]["chain_us"] == [11.0, 13.9, 11.2]
    assert sv.merge_repeats([{"label": "x", "M": 1, "error": "e"}])["error"] == "e"
    assert "samples" not in sv.merge_repeats(runs[:1])


def test_sweep_grid_is_buildable_variants():
    """Every default-grid job is a valid variant whose label parses back (gpu_cache.sh builds them by label)."""
    from musekern.kernels.qkv_front.rules import fixed_rows, token_tiles
    from musekern.plan import variant_from_label
    from musekern.targets import get_target

    sv = _sweep_module()
    jobs = sv.grid_jobs()
    assert jobs
    for v, m in jobs:
        assert variant_from_label(v.label) == v
        assert (v.tiles, v.fixed_rows) == (token_tiles(m, v.n, get_target("h200")), fixed_rows(m))


def test_sweep_occupancy_asks_the_driver_with_the_kernels_launch_config(monkeypatch):
    """bench/sweep_variants.py's occupancy row uses only the loader's public surface and the driver's launch config
    (a private loader helper it once called went away in the host-cost change, and only a GPU run noticed)."""
    from types import SimpleNamespace

    from musekern.store.abi import LaunchSpec

    sv = _sweep_module()
    seen = {}

    def blocks(func, threads, smem):
        seen["blocks"] = (func, threads, smem)
        return (0, 2)

    def clusters(func, cfg):
        seen["clusters"] = (func, cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes, cfg.numAttrs)
        return (0, 66)

    monkeypatch.setattr(sv.drv, "cuOccupancyMaxActiveBlocksPerMultiprocessor", blocks)
    monkeypatch.setattr(sv.drv, "cuOccupancyMaxActiveClusters", clusters)
    k = SimpleNamespace(func="F", abi=SimpleNamespace(launch=LaunchSpec(block=(192, 1, 1), cluster=(2, 1, 1),
                                                                       dynamic_smem_bytes=1024, pdl=True)))
    assert sv.occupancy(k) == {"blocks_per_sm": 2, "active_clusters": 66}
    assert seen == {"blocks": ("F", 192, 1024), "clusters": ("F", 264, 192, 1024, 1)}  # the cluster attribute only
