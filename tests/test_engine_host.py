"""bench/engine_host.py on CPU: the empty ops of both registration routes (same schema as musekern::qkv_front, both
callable), the launch path's rows (the driver stubbed: bench/host_cpu.py) and the report it writes. The timing itself
runs on the GPU machine (bench/gpu_engine.sh); bench/host_cpu.py times the Python part here."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from musekern.ops import library  # noqa: E402

_spec = importlib.util.spec_from_file_location("engine_host", Path(__file__).resolve().parents[1] / "bench" /
                                               "engine_host.py")
engine_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_host)
_hs = importlib.util.spec_from_file_location("host_cpu", Path(__file__).resolve().parents[1] / "bench" / "host_cpu.py")
host_cpu = importlib.util.module_from_spec(_hs)
_hs.loader.exec_module(host_cpu)


def test_empty_ops_of_both_routes_take_the_real_schema():
    y = torch.zeros(2, 2176, dtype=torch.bfloat16)
    lib, lib_empty, custom_empty = engine_host.empty_ops(y, key="CPU")
    kv = torch.zeros(2, 4, 16, 1, 64, dtype=torch.bfloat16)
    args = (torch.zeros(2, 8192, dtype=torch.bfloat16), torch.zeros(2176, 8192, dtype=torch.bfloat16),
            torch.zeros(2, dtype=torch.int64), torch.zeros(64, 64), torch.zeros(2, dtype=torch.int64), kv[0], kv[1],
            1, 1e-5)
    assert lib_empty(*args) is y and torch.equal(custom_empty(*args), y)
    real = str(torch.ops.musekern.qkv_front.default._schema).split("(", 1)[1]
    for op in (lib_empty, custom_empty):
        assert str(op._schema).split("(", 1)[1] == real
    del lib


def test_report_ratios_and_target():
    res = {engine_host.MM_ROW: {"median_us": 10.0, "min_us": 9.0, "max_us": 12.0},
           engine_host.OP_ROW: {"median_us": 16.0, "min_us": 15.0, "max_us": 18.0}}
    doc, table = engine_host.report(res, {"n": 1}, {"commit": "abc", "device": "X", "shape": {"M": 1}})
    assert doc["rows"][engine_host.OP_ROW]["x_mm"] == pytest.approx(1.6)
    assert doc["target"] == {"op_vs_mm": 1.5, "op_vs_mm_measured": pytest.approx(1.6), "pass": False}
    assert doc["commit"] == "abc" and table[-1].startswith("op / torch.mm = 1.60") and "MISS" in table[-1]
    assert library.QKV_FRONT_SCHEMA.startswith("qkv_front(")


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="the front's ABI comes from its kernel module")
def test_the_launch_breakdown_rows_run_and_the_cpu_bench_measures():
    """The GPU bench's private-helper rows resolve against this commit's code (an API drift would only show as a
    breakdown_error in a GPU run), and bench/host_cpu.py's rows each run, on the stubbed driver."""
    from musekern.ops import qkv_front as ops

    fake = host_cpu.fake_gpu()
    try:
        host_cpu.load_front(1)
        args = host_cpu.inputs(1)
        y = torch.empty(1, host_cpu.N, dtype=torch.bfloat16)
        rows, notes = engine_host.launch_breakdown(ops, args, y, host_cpu.N, host_cpu.NKV, 1)
        assert notes == {} and len(rows) == 5
        for fn in rows.values():
            fn()
        cpu_rows, _lib = host_cpu.build_rows(1)
        res = host_cpu.measure(cpu_rows, rounds=1, calls=2)
        assert set(res) == set(cpu_rows) and all(r["median_us"] > 0 for r in res.values())
    finally:
        fake.undo()
