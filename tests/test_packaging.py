"""Packaging: what `pip install musekern` and `musekern[build]` pull (no torch), the cuda-bindings range and the
drivers it needs, the wheel the README's Dockerfile installs, and the ops' one-line error without torch.

The metadata tests read this venv's installed metadata (`make install` reinstalls whenever pyproject.toml changes).
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
HAVE_DSL = importlib.util.find_spec("cutlass") is not None
NO_TORCH = "import sys; sys.modules['torch'] = None\n"  # `import torch` raises ModuleNotFoundError from here on
BINDINGS_RANGE = ">=12.8,<14"


def _planned() -> int:
    from musekern.config import load_config
    from musekern.plan import plan_model
    from musekern.targets import get_target

    return len(plan_model(load_config(), [get_target("h200")]))


PLANNED = _planned()  # the bundled model's builds for h200 (tests/test_variants.py::test_default_plan counts them)


def _requires(dist: str, extra: str = "") -> list[Requirement]:
    """The requirements of an installed distribution that apply with `extra` ("" = the plain install)."""
    out = []
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            out.append(req)
    return out


def _closure(dist: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Every distribution `pip install dist[extras]` pulls, walked through the installed metadata."""
    seen: set[str] = set()
    todo = [(dist, e) for e in ("", *extras)]
    while todo:
        name, extra = todo.pop()
        try:
            reqs = _requires(name, extra)
        except md.PackageNotFoundError:
            continue  # not installed here (its marker was false for this Python, or an optional extra)
        for req in reqs:
            n = canonicalize_name(req.name)
            for e in ("", *sorted(req.extras)):
                if (n, e) not in seen:
                    seen.add((n, e))
                    todo.append((n, e))
    return {n for n, _ in seen}


# The runtime install, and the build stage's: neither may pull torch (a multi-GB CUDA wheel for nothing).
@pytest.mark.parametrize("extras", [(), ("build",)])
def test_the_runtime_and_the_build_stage_pull_no_torch(extras):
    deps = _closure("musekern", extras)
    assert "torch" not in deps, sorted(deps)
    assert ("nvidia-cutlass-dsl" in deps) == ("build" in extras) and "cuda-bindings" in deps


def test_torch_is_an_extra():
    torch_reqs = [Requirement(r) for r in md.requires("musekern") if Requirement(r).name == "torch"]
    assert torch_reqs and all(r.marker is not None and r.marker.evaluate({"extra": "torch"})
                              and not r.marker.evaluate({"extra": ""}) for r in torch_reqs)


def test_cuda_bindings_range_is_declared_installed_and_documented():
    (base,) = [r for r in _requires("musekern") if r.name == "cuda-bindings"]
    assert base.specifier == SpecifierSet(BINDINGS_RANGE)
    (cu12,) = [r for r in _requires("musekern", "cu12") if r.name == "cuda-bindings" and r.marker is not None]
    assert "13.0" not in cu12.specifier and "12.9.0" in cu12.specifier
    assert md.version("cuda-bindings") in base.specifier  # what this venv resolved satisfies it
    readme = (ROOT / "README.md").read_text()
    # the README names the range, the drivers each major needs, and the way to stay on 12.x
    for fact in (f"cuda-bindings{BINDINGS_RANGE}", "R525.60.13", "R580.65.06", "musekern[cu12]"):
        assert fact in readme, fact


def _run(code: str, *args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def test_the_ops_without_torch_say_which_extra():
    for use in ("import musekern; musekern.qk_norm", "import musekern.ops.qkv_front"):
        r = _run(NO_TORCH + use)
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("ModuleNotFoundError: musekern's ops") and "pip install 'musekern[torch]'" in last


def test_the_cli_plans_without_torch(tmp_path):
    r = _run(NO_TORCH + "from musekern.cli import main; main()", "plan", "--target", "h200", "--json",
             env={"MUSEKERN_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["variants"]) == PLANNED and "torch" not in r.stderr


@pytest.mark.skipif(not HAVE_DSL, reason="needs the build extra (nvidia-cutlass-dsl)")
@pytest.mark.slow
def test_prepare_compiles_without_torch(tmp_path):
    r = _run(NO_TORCH + "from musekern.cli import main; main()", "prepare", "--target", "h200", "--variant",
             "qk_norm[dtype=bfloat16,has_scale=False,head_dim=64]", "--cache-dir", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["counts"]["built"] == 1


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from the tracked files, as on a fresh clone)")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("wheel") is None,
                    reason="needs setuptools and wheel (the test extra)")
def test_the_wheel_of_a_fresh_clone_installs_and_runs(tmp_path):
    """The README's Dockerfile installs this repository: build the wheel from the tracked files alone (a fresh
    clone: an ignored file that the package needs is caught here), install it into an empty folder, run it."""
    src = tmp_path / "src"
    tracked = _tracked_files()
    for f in tracked:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (tmp_path / "dist").glob("musekern-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    shipped = {f for f in tracked if f.startswith("musekern/") and f.endswith((".py", ".json"))}
    assert shipped and shipped <= names, sorted(shipped - names)
    # the research harness stays in the repository (bench/harness/); the wheel ships the package alone, with the
    # small `musekern bench` command and the GEMM path in one folder
    assert not [n for n in names if n.startswith(("musekern/bench/", "bench/"))], sorted(names)
    assert not [n for n in names if n.split("/")[0] != "musekern" and ".dist-info/" not in n], sorted(names)
    assert {"musekern/cli/bench_cmd.py", "musekern/gemm/cublaslt.py", "musekern/gemm/tune.py",
            "musekern/gemm/records.py"} <= names
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    plain = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert not any("torch" in ln for ln in plain) and any("cuda-bindings" in ln for ln in plain), plain
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(site), str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    code = ("import musekern, musekern.builder, musekern.store.cache, musekern.runtime, musekern.plan\n"
            "from musekern.builder import BuildExtraMissing\n"
            f"assert musekern.__file__.startswith({str(site)!r}), musekern.__file__\n"
            "from musekern.cli import main; main()")
    r = _run(code, "plan", "--target", "h200", "--json", env={"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout)["variants"]) == PLANNED
