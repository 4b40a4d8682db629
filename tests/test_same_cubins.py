"""bench/same_cubins.py: a cache's cubins against this tree's, by label (CPU; the compile needs the build extra)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
same_cubins = pytest.importorskip("same_cubins")

from musekern.kernels.qkv_epilogue.variant import QkvEpilogueVariant  # noqa: E402

# one small build in a real cache (prepare), then that entry's manifest lying about its bytes, then a build the cache
# lacks: the three verdicts the script gives
V = QkvEpilogueVariant(1)
OTHER = QkvEpilogueVariant(2)


def test_same_differs_missing(tmp_path):
    pytest.importorskip("cutlass")
    from click.testing import CliRunner

    from musekern.cli import main

    r = CliRunner().invoke(main, ["prepare", "--target", "h200", "--cache-dir", str(tmp_path), "--variant", V.label])
    assert r.exit_code == 0, r.output
    assert same_cubins.compare(str(tmp_path), [V]) == []
    assert same_cubins.compare(str(tmp_path), [OTHER]) == [f"missing: {OTHER.label}"]
    (manifest,) = tmp_path.glob("v*/entries/*/manifest.json")
    doc = json.loads(manifest.read_text())
    doc["cubin_sha256"] = "0" * 64
    manifest.write_text(json.dumps(doc))
    assert same_cubins.compare(str(tmp_path), [V]) == [f"differs: {V.label}"]
