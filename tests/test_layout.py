"""The package's import drawing, read statically from every module (lazy imports inside functions included).

The rules (issue 27): no import circle between the package's parts; the serving leg (runtime/) stands on the store
and the driver layer only, never on the builder, the planner or the GEMM path; the store names no kernel
(tests/test_store_keys.py) and imports no other part (the GEMM tuning records reach its maintenance through
store/record_folders.py); the GEMM path is one folder (gemm/) the ops stand on; every kernel is one folder under
kernels/ listed in plan.REGISTRY, and only the builder compiles (imports cutlass).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from musekern.plan import REGISTRY

PKG = Path(__file__).resolve().parent.parent / "musekern"
# modules that import nothing of musekern (stdlib or the driver bindings only): any layer may stand on them
LEAVES = {"env", "targets", "model", "kv_cache"}


def _part(rel: str) -> str:
    """The part of the package a file belongs to: its top folder, or the module name of a top-level file."""
    first = rel.split("/")[0]
    return first[:-3] if first.endswith(".py") else first


def _imports(path: Path) -> set[str]:
    """Package-relative module paths (dotted, from the package root) that a file imports, lazily or not."""
    rel = path.relative_to(PKG)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel.parent.parts)[: len(rel.parent.parts) - (node.level - 1)]
                mod = base + (node.module.split(".") if node.module else [])
                names = [mod + [a.name] for a in node.names] if not node.module else [mod]
                out |= {".".join(m) for m in names}
            elif node.module and node.module.split(".")[0] == "musekern":
                out.add(".".join(node.module.split(".")[1:]))
        elif isinstance(node, ast.Import):
            out |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "musekern"}
    return {m for m in out if m}


def _graph() -> dict[str, set[str]]:
    """part -> the parts it imports (itself left out)."""
    g: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).as_posix()
        if rel.startswith("bench/"):
            continue
        src = _part(rel)
        g.setdefault(src, set())
        for m in _imports(f):
            dst = m.split(".")[0]
            if dst != src and ((PKG / dst).is_dir() or (PKG / f"{dst}.py").exists()):
                g[src].add(dst)
    return g


def _cutlass_importers() -> set[str]:
    out = set()
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(m.split(".")[0] == "cutlass" for m in mods):
                out.add(f.relative_to(PKG).as_posix())
    return out


def test_no_import_circle_between_the_parts():
    g = _graph()
    seen, stack = set(), []

    def visit(p):
        if p in stack:
            raise AssertionError(f"import circle: {' -> '.join(stack[stack.index(p):] + [p])}")
        if p in seen:
            return
        stack.append(p)
        for q in sorted(g.get(p, ())):
            visit(q)
        stack.pop()
        seen.add(p)

    for p in sorted(g):
        visit(p)


def test_no_import_circle_inside_ops():
    """ops/: the shared helpers (checks, _bind) import no op; the every-M op imports the epilogue's, never back."""
    ops = {f.stem: {m.split(".")[1] for m in _imports(f) if m.startswith("ops.") and m.count(".") >= 1}
           for f in (PKG / "ops").glob("*.py")}
    for a, deps in ops.items():
        for b in deps:
            assert a not in ops.get(b, set()), f"ops/{a}.py and ops/{b}.py import each other"
    assert not ops["checks"] - {"checks"} and not ops["_bind"] - {"_bind"}


@pytest.mark.parametrize("part,allowed", [
    # the serving leg: the store and the driver layer (runtime's own modules), and the leaves
    ("runtime", {"store"} | LEAVES),
    # the artifact contract: itself and the leaves (the GEMM records come in through a registered hook)
    ("store", LEAVES),
    # the GEMM path: its records on the store, its launch on the loader's stream and cache; the FP8 weight's
    # (gemm/fp8.py, issue 30) x quantization and dequantization are the reference's and the packer's, not copies
    ("gemm", {"store", "runtime", "reference", "weights"} | LEAVES),
    # the torch-facing ops: the GEMM path, the loader, the kernels' pure variant modules, the builder's autobuild hook
    # (ops/checks.py only: test below), the reference for CPU tensors, the weight formats (prepare's weight_format);
    # never the planner's registry or the CLI
    ("ops", {"gemm", "runtime", "kernels", "builder", "reference", "config", "weights"} | LEAVES),
    # the kernels: their ABI record format and their key's label spelling are the store's
    ("kernels", {"store"} | LEAVES),
    ("plan", {"kernels", "config", "store"} | LEAVES),
    # a --model file is read through the store's bounded, typed reader (store/fs.read_regular, manifest.parse_json);
    # its quantization_config by weights/formats.py
    ("config", {"store", "weights"} | LEAVES),
    # the FP8 weight formats and the packer (issue 30): pure, on the leaves only (the shape constants, E4M3_MAX)
    ("weights", LEAVES),
])
def test_each_part_imports_only_what_it_stands_on(part, allowed):
    got = _graph().get(part, set())
    assert got <= allowed, f"{part} imports {sorted(got - allowed)}"


def test_only_the_cli_and_the_autobuild_hook_reach_the_builder():
    """Serving and building are two legs on the store: the runtime never imports the builder (not even lazily); the
    ops reach it only through the on_miss hook they hand the loader (ops/checks.py), the CLI for prepare."""
    g = _graph()
    assert {p for p, deps in g.items() if "builder" in deps} <= {"cli", "ops"}
    users = [f.relative_to(PKG).as_posix() for f in (PKG / "ops").glob("*.py")
             if any(m.startswith("builder") for m in _imports(f))]
    assert users == ["ops/checks.py"]


def test_the_gemm_path_is_one_folder():
    """The cuBLASLt binding, the tuning and its records, and the FP8 weight's GEMM live in gemm/ and nowhere else;
    the store and the runtime name none of them."""
    assert {f.name for f in (PKG / "gemm").glob("*.py")} == {"__init__.py", "cublaslt.py", "tune.py", "records.py",
                                                             "fp8.py"}
    for part in ("store", "runtime", "ops"):
        assert not {f.name for f in (PKG / part).glob("*.py")} & {"cublaslt.py", "gemm.py", "tuning.py"}, part
    assert {p for p, deps in _graph().items() if "gemm" in deps} <= {"ops", "cli", "__init__"}


def test_only_the_kernels_and_the_builder_import_cutlass():
    kernel_dirs = {f"kernels/{name}/" for name in REGISTRY}
    for rel in _cutlass_importers():
        assert rel == "builder/dsl.py" or any(rel.startswith(d) for d in kernel_dirs), rel


def test_every_kernel_is_one_registered_folder():
    """A kernel is a folder under kernels/ with variant.py, abi.py and kernel.py, listed once in plan.REGISTRY; no
    kernel file lives outside its folder."""
    folders = {p.name for p in (PKG / "kernels").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders == set(REGISTRY)
    for name, spec in REGISTRY.items():
        assert spec.variant.kernel == name and spec.kernel_module == f"musekern.kernels.{name}.kernel"
        for f in ("__init__.py", "variant.py", "abi.py", "kernel.py"):
            assert (PKG / "kernels" / name / f).exists(), f"kernels/{name}/{f}"
    loose = {f.name for f in (PKG / "kernels").glob("*.py")}
    assert loose == {"__init__.py", "base.py"}, loose


def test_no_package_folder_is_named_build():
    """Python's usual .gitignore pattern `build/` and tools that treat build/ as output would skip it."""
    assert not any(p.name == "build" for p in PKG.rglob("*") if p.is_dir())


def test_the_weight_formats_import_no_torch():
    """config.py reads the weight format on every command (no torch there); only weights/pack.py handles tensors."""
    for f in (PKG / "weights").glob("*.py"):
        mods = {a.name.split(".")[0] for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Import)
                for a in n.names} | {n.module.split(".")[0] for n in ast.walk(ast.parse(f.read_text()))
                                     if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert "torch" not in mods or f.name == "pack.py", f.name
        assert not mods & {"cutlass", "cuda"}, f.name
