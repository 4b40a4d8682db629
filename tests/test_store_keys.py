"""store/keys.py: a key is stable, every named part moves it, and its parts round-trip through JSON."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from store_fakes import SRC, fake_parts

from musekern.store.keys import COMMON_SOURCES, KERNEL_SOURCES, PART_NAMES, KeyParts

PKG = Path(__file__).resolve().parent.parent / "musekern"


def test_key_is_stable_and_independent_of_param_order():
    a = KeyParts.make("qk_norm", {"dtype": "bfloat16", "head_dim": 64}, "sm_90a", SRC, "4.8.1", 1)
    b = KeyParts.make("qk_norm", {"head_dim": 64, "dtype": "bfloat16"}, "sm_90a", SRC, "4.8.1", 1)
    assert a == b and a.key() == b.key() and len(a.key()) == 64
    assert KeyParts.from_json(json.loads(json.dumps(a.to_json()))) == a
    assert set(a.to_json()) == set(PART_NAMES)
    assert a.label == "qk_norm[dtype=bfloat16,head_dim=64]"


@pytest.mark.parametrize("change", [
    dict(kernel="qkv_front"), dict(i=1), dict(arch="sm_100a"), dict(src="cd" * 32), dict(dsl="4.9.0"), dict(abi=2)])
def test_every_named_part_changes_the_key(change):
    """Invalidation you can explain: source, variant, arch, DSL and ABI version all feed the key."""
    base = fake_parts(0)
    other = fake_parts(**{"i": 0, **change})
    assert other.key() != base.key()
    assert len(other.differences(base)) == 1


def test_key_parts_from_json_rejects_unknown_or_missing_parts():
    d = fake_parts().to_json()
    with pytest.raises(ValueError):
        KeyParts.from_json({**d, "extra": 1})
    d.pop("arch")
    with pytest.raises(ValueError):
        KeyParts.from_json(d)


def test_family_ignores_only_the_dsl_version():
    a = fake_parts(dsl="4.8.1")
    assert a.family() == fake_parts(dsl="5.0").family() != fake_parts(dsl="4.8.1", arch="sm_100a").family()
    assert a.family() != a.key()


def _package_imports(rel: str) -> set[str]:
    """The musekern files a module imports by relative import (`from .x import`, `from ..variants.y import`), as paths
    relative to the package; a package import (`from . import X`) names its __init__.py."""
    path = PKG / rel
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*node.module.split(".")) if node.module else base
            f = target.with_suffix(".py") if target.with_suffix(".py").exists() else target / "__init__.py"
            out.add(f.relative_to(PKG).as_posix())
    return out


@pytest.mark.parametrize("kernel", sorted(KERNEL_SOURCES))
def test_every_kernel_file_a_kernel_imports_is_in_its_key(kernel):
    """A kernel's cubin is made by its module and every kernels/ module it imports (transitively), with the constants
    of the variant modules they import: each must be hashed into the key, or an edit to it would be served from a
    stale cache entry. (kernels/__init__.py holds the CompiledKernel record only.)"""
    sources = set(KERNEL_SOURCES[kernel]) | set(COMMON_SOURCES)
    seen, todo = set(), [KERNEL_SOURCES[kernel][0]]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for dep in _package_imports(rel):
            if dep.startswith("kernels/") and dep != "kernels/__init__.py":
                todo.append(dep)
            elif dep.startswith("variants/"):
                seen.add(dep)
    missing = sorted(f for f in seen - sources if f != "kernels/__init__.py")
    assert not missing, f"{kernel}: add {missing} to musekern/store/keys.py::KERNEL_SOURCES"
