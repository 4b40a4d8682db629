"""gemm/tune.py on the CPU: which measured candidate it keeps, which recorded pick it accepts without timing, and an
untuned shape is torch.mm's product. (Tuning and the cuBLASLt launches run on the GPU: tests/test_gpu_gemm.py.)"""
import pytest
import torch

from musekern.gemm import tune as gemm
from musekern.gemm.cublaslt import Candidate
from musekern.gemm.records import Record


# the margin's edges: a candidate must beat torch.mm by more than 3% to replace it
@pytest.mark.parametrize("us, want", [
    ({"mm": 25.0, "lt[a]": 21.0, "lt[b]": 22.0}, "lt[a]"),   # clearly faster
    ({"mm": 25.0, "lt[a]": 24.3}, "mm"),                     # 2.8%: within the margin, noise keeps torch.mm
    ({"mm": 25.0, "lt[a]": 24.2}, "lt[a]"),                  # 3.2% faster
    ({"mm": 20.0, "lt[a]": 21.0}, "mm"),                     # slower
    ({"lt[a]": 21.0, "lt[b]": 20.0}, "lt[b]"),               # torch.mm not timed (refused): the fastest
])
def test_pick(us, want):
    assert gemm.pick(us) == want


def test_an_untuned_shape_is_torch_mm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, gemm.HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.randn(24, gemm.HIDDEN, generator=g).to(torch.bfloat16)
    out = torch.empty(5, 24, dtype=torch.bfloat16)
    assert gemm.mm(x, w, out) is out
    assert torch.equal(out, torch.mm(x, w.t()))



def test_a_misaligned_call_is_torch_mm(monkeypatch):
    # a tuned shape whose x is a view 16 bytes into its storage (qkv_front accepts 16-byte alignment; cuBLASLt's
    # heuristic assumed 256): torch.mm takes it, the tuned launch is never called
    called = []
    monkeypatch.setitem(gemm._RUNS, (24, 5, -1), (lambda *a: called.append(a), 0))
    g = torch.Generator().manual_seed(1)
    store = torch.randn(5 * gemm.HIDDEN + 8, generator=g).to(torch.bfloat16)
    x = store[8:].view(5, gemm.HIDDEN)
    w = torch.randn(24, gemm.HIDDEN, generator=g).to(torch.bfloat16)
    out = torch.empty(5, 24, dtype=torch.bfloat16)
    assert x.data_ptr() % 256 and gemm.mm(x, w, out) is out
    assert not called and torch.equal(out, torch.mm(x, w.t()))


class _Offers:
    """A stand-in for cublaslt.Matmul: the candidates cuBLASLt offers for a shape now."""

    def __init__(self, *cands):
        self.cands = list(cands)

    def candidates(self):
        return self.cands


# a tuning record is advice: the pick is re-decided from its times by today's rule, and an algorithm is used only
# where cuBLASLt still offers those exact bytes under that name (and its result matches torch.mm's: the last two)
OFFERED = Candidate(bytes(range(64)), 0, 317, 1)
WON = {"mm": 25.0, OFFERED.name: 20.0}


@pytest.mark.parametrize("rec, offered, want", [
    (Record("mm", None, 0, {"mm": 15.1, "lt[a]": 15.0}), (), "mm"),             # torch.mm recorded: no launch needed
    (Record("mm", None, 0, {"mm": 25.0, "lt[a]": 20.0}), (), None),             # times say lt[a]: recorded otherwise
    (Record(OFFERED.name, OFFERED.algo, 0, {"mm": 25.0, OFFERED.name: 24.5}), (OFFERED,), None),  # within the margin
    (Record(OFFERED.name, bytes(64), 0, WON), (OFFERED,), None),                # bytes not offered: time again
    (Record(OFFERED.name, OFFERED.algo, 1024, WON), (OFFERED,), None),          # offered with another workspace
    (Record("lt[a]", OFFERED.algo, 0, {"mm": 25.0, "lt[a]": 20.0}), (OFFERED,), None),  # under another name
])
def test_a_recorded_pick_is_rechecked(monkeypatch, rec, offered, want):
    monkeypatch.setattr(gemm, "_RUNS", {})
    monkeypatch.setattr(gemm, "_check", lambda *a: pytest.fail("no launch for a record refused before it"))
    got = gemm._from_record(_Offers(*offered), rec, None, 24, 65, -1)
    if want is None:
        assert got is None
    else:
        assert got.chosen == want and got.recorded and got.us == rec.us
    assert gemm._RUNS == {}  # torch.mm, or nothing: no cuBLASLt launcher kept


class _Launchable(_Offers):
    def launcher(self, cand):
        return lambda *a: None


@pytest.mark.parametrize("check, kept", [(None, True), ("max |y - torch.mm| = 9 > 0.1", False)])
def test_an_offered_recorded_algorithm_is_kept_only_if_its_result_checks(monkeypatch, check, kept):
    monkeypatch.setattr(gemm, "_RUNS", {})
    monkeypatch.setattr(gemm, "_check", lambda *a: check)
    W0 = torch.randn(24, gemm.HIDDEN).to(torch.bfloat16)  # the check's inputs are made; its launch is the stub's
    got = gemm._from_record(_Launchable(OFFERED), Record(OFFERED.name, OFFERED.algo, 0, WON), W0, 24, 65, -1)
    if kept:
        assert got.chosen == OFFERED.name and got.recorded and gemm._RUNS[(24, 65, -1)][1] == 0
    else:
        assert got is None and gemm._RUNS == {}


# ties break by name, not by the order of the times (a record's JSON comes back sorted)
def test_a_tie_picks_the_same_whatever_the_order():
    a = {"mm": 30.0, "lt[b]": 20.0, "lt[a]": 20.0}
    assert gemm.pick(a) == gemm.pick(dict(sorted(a.items()))) == "lt[a]"
