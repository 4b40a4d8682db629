"""gemm/cublaslt.py on the CPU: the C structures' sizes against cublasLt.h, where the library is looked for, the
error without one, and the candidates' records. (Its calls run on the GPU: tests/test_gpu_gemm.py.)"""
import ctypes

import pytest

from musekern.gemm import cublaslt


def test_structures_match_the_header():
    # cublasLtMatmulAlgo_t is uint64_t data[8]; cublasLtMatmulHeuristicResult_t adds size_t workspaceSize,
    # cublasStatus_t state, float wavesCount, int reserved[4]
    assert ctypes.sizeof(cublaslt.Algo) == 64
    assert ctypes.sizeof(cublaslt.Heuristic) == 96
    assert cublaslt.Heuristic.workspaceSize.offset == 64
    assert cublaslt.Heuristic.wavesCount.offset == 76


def test_library_paths_prefer_the_mapped_copy(tmp_path, monkeypatch):
    maps = tmp_path / "maps"
    mapped = "/opt/torch/lib/nvidia/cu13/lib/libcublasLt.so.13"
    maps.write_text(f"7f00-7f01 r-xp 0 08:01 1 {mapped}\n7f02-7f03 r-xp 0 08:01 2 /usr/lib/libc.so.6\n"
                    f"7f04-7f05 r--p 0 08:01 1 {mapped}\n")
    wheel = tmp_path / "site" / "nvidia" / "cublas" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libcublasLt.so.12").write_bytes(b"")
    monkeypatch.setattr("sys.path", [str(tmp_path / "site")])
    assert cublaslt.library_paths(str(maps)) == [mapped, str(wheel / "libcublasLt.so.12")]
    assert cublaslt.library_paths(str(tmp_path / "no-maps")) == [str(wheel / "libcublasLt.so.12")]


@pytest.fixture
def fresh_library(monkeypatch):
    """`library()` looked up again under the test's monkeypatches, and forgotten after it."""
    cublaslt.library.cache_clear()
    yield monkeypatch
    cublaslt.library.cache_clear()


def test_no_library_is_a_one_line_error(fresh_library):
    fresh_library.setattr(cublaslt, "library_paths", lambda: [])
    with pytest.raises(cublaslt.CublasLtError, match="no libcublasLt found.*pip install torch"):
        cublaslt.library()


def test_an_unloadable_path_is_skipped(tmp_path, fresh_library):
    bad = tmp_path / "libcublasLt.so.13"
    bad.write_bytes(b"not an ELF")
    fresh_library.setattr(cublaslt, "library_paths", lambda: [str(bad)])
    with pytest.raises(cublaslt.CublasLtError, match="no libcublasLt found"):
        cublaslt.library()


def test_status_names_the_failure():
    with pytest.raises(cublaslt.CublasLtError, match="cublasLtMatmul failed: CUBLAS_STATUS_NOT_SUPPORTED"):
        cublaslt.Library.check(15, "cublasLtMatmul")
    cublaslt.Library.check(0, "cublasLtMatmul")  # success raises nothing


def test_candidate_name_says_what_it_is():
    c = cublaslt.Candidate(b"\0" * 64, workspace=1 << 20, tile=313, splitk=3)
    assert c.name == "lt[tile=313,splitk=3,ws=1048576]"


class _FakeDll:
    """Records every cuBLASLt call a Matmul makes (values read through the ctypes references), succeeds."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            vals = []
            for a in args:
                obj = getattr(a, "_obj", a)  # byref(x) -> x
                vals.append(getattr(obj, "value", obj))
            self.calls.append((name, vals))
            return 0
        return call


def _fake_library():
    lib = cublaslt.Library.__new__(cublaslt.Library)
    lib.dll, lib._handles = _FakeDll(), {0: ctypes.c_void_p(1)}
    return lib


# the descriptors as cuBLASLt sees row-major tensors (module docstring), and a launch is one cublasLtMatmul with the
# pointers in cuBLASLt's A = W, B = x, D = y places
def test_a_matmul_sets_its_types_and_launches_one_call():
    lib = _fake_library()
    mat = cublaslt.Matmul(lib, 2176, 48, 0)
    made = lib.dll.calls
    layouts = [v[1:] for name, v in made if name == "cublasLtMatrixLayoutCreate"]
    assert layouts == [[cublaslt.R_16BF, 8192, 2176, 8192], [cublaslt.R_16BF, 8192, 48, 8192],
                       [cublaslt.R_16BF, 2176, 48, 2176]]
    attrs = {v[1]: v[2] for name, v in made if name == "cublasLtMatmulDescSetAttribute"}
    assert attrs == {cublaslt.DESC_TRANSA: cublaslt.OP_T, cublaslt.DESC_TRANSB: cublaslt.OP_N}
    lib.dll.calls = []
    mat.launcher(cublaslt.Candidate(b"\0" * 64, 0, 1, 1))(0x1000, 0x2000, 0x3000, 0, 7)
    assert [name for name, _ in lib.dll.calls] == ["cublasLtMatmul"]
    w, x, y = lib.dll.calls[-1][1][3], lib.dll.calls[-1][1][5], lib.dll.calls[-1][1][8]
    assert (w, x, y) == (0x1000, 0x2000, 0x3000)
