"""`musekern bench` (musekern/cli/bench_cmd.py): the small user-facing timing. On the CPU: its refusals (no GPU, no
torch, bad options: one line, exit 1 / 2), its rotation and graph-size rules, its row math, its size; on the GPU
machine (marked `gpu`): a real run against the prepared cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from musekern.cli import bench_cmd, main
from musekern.config import load_config

H200_L2 = 60 << 20  # what torch reports on the H200 (torch.cuda.get_device_properties().L2_cache_size)


def test_without_a_gpu_it_exits_1_with_one_line(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["bench", "--tp", "8"])
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "needs a CUDA GPU" in r.stderr and r.stderr.startswith("musekern: error:")


def test_without_torch_it_says_which_extra():
    code = "import sys; sys.modules['torch'] = None\nfrom musekern.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, "bench"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "pip install 'musekern[torch]'" in r.stderr, r.stderr


# bad options are usage errors (exit 2) found before any GPU is looked for
@pytest.mark.parametrize("args,says", [(["--m", "0"], "--m"), (["--samples", "2"], "--samples"),
                                       (["--tp", "x"], "--tp"), (["--model", "/nonexistent.json"], "nonexistent")])
def test_bad_options_are_usage_errors(args, says):
    r = CliRunner().invoke(main, ["bench", *args])
    assert r.exit_code == 2 and says in r.stderr, r.stderr


def test_help_names_the_options():
    r = CliRunner().invoke(main, ["bench", "--help"])
    assert r.exit_code == 0
    for opt in ("--model", "--tp", "--m", "--samples", "--cache-dir", "--json"):
        assert opt in r.stdout


# the bundled model's shards on the H200: TP8's weights (36 MB) need 4 copies to stream 2 x the 60 MB L2, TP1's
# (285 MB) the minimum of 2; a decode-size qk_norm input (17 KB at M = 1) is capped at 64 buffers
@pytest.mark.parametrize("tp,want", [(8, 4), (4, 2), (2, 2), (1, 2)])
def test_weights_rotate_past_the_l2(tp, want):
    n = load_config().shard(tp).n
    assert bench_cmd.copies(n * 8192 * 2, H200_L2) == want
    assert want * n * 8192 * 2 >= bench_cmd.ROTATE_L2 * H200_L2


@pytest.mark.parametrize("nbytes,want", [(1 * 136 * 64 * 2, 64), (16 << 20, 8), (1 << 30, 2), (0, 64)])
def test_small_inputs_rotate_over_more_buffers_up_to_a_cap(nbytes, want):
    assert bench_cmd.copies(nbytes, H200_L2) == want


# one pass of a graph's rotated calls: TP8's 4 fronts at M = 1 (~36 us), TP1's 2 (~140 us), a prefill pass longer
# than the target (one pass), and a degenerate 0 (capped)
@pytest.mark.parametrize("pass_us,want", [(36.0, 56), (140.0, 15), (5000.0, 1), (0.0, 1000)])
def test_a_graph_holds_enough_passes_to_fill_its_replay(pass_us, want):
    assert bench_cmd.passes(pass_us) == want


def test_a_row_derives_speedup_and_bandwidth_from_the_times():
    shard = load_config().shard(8)
    r = bench_cmd.row("qkv_front", shard, 1, "front", 9.0, "torch.mm", 13.5, shard.n * 8192 * 2, "ok")
    assert (r["tp"], r["N"], r["M"], r["speedup"]) == (8, 2176, 1, 1.5)
    assert r["gbps"] == round(2176 * 8192 * 2 / 9e-6 / 1e9, 1)
    assert list(r) == ["op", "tp", "N", "M", "path", "musekern_us", "baseline", "baseline_us", "speedup", "gbps",
                       "check"]


def test_the_command_stays_small():
    """Issue 27 rule 6: the package's bench is a small command (<= ~300 lines); the research harness is bench/."""
    assert len(Path(bench_cmd.__file__).read_text().splitlines()) <= 300
    assert not (Path(bench_cmd.__file__).parents[1] / "bench").exists()


@pytest.mark.gpu
def test_a_real_run_times_the_planned_kernels(gpu_cache_dir):
    """TP8 at a fused-front M and a GEMM-path M: every row timed, checked, and faster than nothing."""
    r = subprocess.run([sys.executable, "-m", "musekern.cli", "bench", "--tp", "8", "--m", "1", "--m", "65",
                        "--samples", "3", "--json"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MUSEKERN_CACHE_DIR": gpu_cache_dir})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    rows = {(x["op"], x["M"]): x for x in doc["rows"]}
    assert set(rows) == {("qkv_front", 1), ("qk_norm", 1), ("qkv_front", 65), ("qk_norm", 65)}
    assert rows[("qkv_front", 1)]["path"] == "front" and rows[("qkv_front", 65)]["path"] == "gemm+epilogue"
    for x in doc["rows"]:
        assert x["check"] == "ok" and 0 < x["musekern_us"] < 1e4 and 0 < x["baseline_us"] < 1e4, x
