"""store/keys.py: a key is stable, every named part moves it, and its parts round-trip through JSON."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from store_fakes import SRC, fake_parts

from musekern.plan import REGISTRY
from musekern.store.keys import PART_NAMES, KeyParts

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


@pytest.mark.parametrize("kernel", sorted(REGISTRY))  # every registered kernel
def test_every_file_a_kernel_compiles_from_is_in_its_key(kernel):
    """A kernel's cubin and manifest are made by its kernel.py and abi.py and every package module they import
    (transitively): each must be hashed into the key (the variant's `source_files()`), or an edit to it would be
    served from a stale cache entry. The store's own modules other than abi.py only carry the record, and the
    kernels' shared base (VariantMixin) and package __init__ files define nothing the compile reads."""
    spec = REGISTRY[kernel]
    folder = Path(spec.kernel_module.replace(".", "/")).parent.relative_to("musekern").as_posix()
    sources = {f.relative_to(PKG).as_posix() for f in spec.variant.source_files()}
    seen, todo = set(), [f"{folder}/kernel.py", f"{folder}/abi.py"]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        todo += [d for d in _package_imports(rel) if not d.endswith("__init__.py") and d != "kernels/base.py"
                 and (not d.startswith("store/") or d == "store/abi.py")]
    missing = sorted(seen - sources)
    assert not missing, f"{kernel}: add {missing} to {spec.variant.__name__}.sources (or COMMON_SOURCES)"
    assert all(f.exists() for f in spec.variant.source_files())


def test_the_store_names_no_kernel():
    """The store is every kernel's: no module of it names a registered kernel (keys get the files from the variant)."""
    for f in sorted((PKG / "store").glob("*.py")):
        text = f.read_text()
        for kernel in REGISTRY:
            assert f'"{kernel}"' not in text and f"kernels.{kernel}" not in text, f"{f.name} names {kernel}"
