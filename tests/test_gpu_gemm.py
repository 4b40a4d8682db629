"""gemm/tune.py on the GPU (marked `gpu`): tuning times torch.mm beside cuBLASLt's candidates and keeps the fastest;
the kept algorithm's y against an fp64 GEMM (error <= 2x torch.mm's own + a tiny atol; y poisoned first), bit for bit
the same call to call, capturable in a CUDA graph and free of host syncs; the product's GEMM path after `prepare`; the
tuning record a later process checks instead of timing (a forged or read-only one costs a re-timing, nothing else)."""
import pytest
import torch

from musekern.gemm import cublaslt
from musekern.gemm import tune as gemm
from musekern.ops import qkv_front as front

pytestmark = pytest.mark.gpu

ATOL = 1e-3
SHARD_N = (2176, 4352, 8704, 17408)  # TP 8, 4, 2, 1
# M: the GEMM path's edges (17: past TP1's front; 49, 65: past TP2's / TP4's and TP8's; 100: inside a cuBLAS tile;
# 128, 256: where torch.mm's choice stepped, bench/results/h200-gemm-dispatch.json; 512: the largest tuned)
MS = (17, 49, 65, 100, 128, 256, 512)


def _operands(n, m, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, gemm.HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, gemm.HIDDEN, device="cuda", generator=g) / gemm.HIDDEN ** 0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("n", SHARD_N)
@pytest.mark.parametrize("m", MS)
def test_tuned_gemm_matches_fp64_and_repeats_bit_for_bit(n, m):
    choice = gemm.tune(n, [m], torch.cuda.current_device())[0]
    assert "mm" in choice.us and len(choice.us) > 1, choice  # torch.mm and cuBLASLt's candidates were timed
    assert choice.chosen == gemm.pick(choice.us)
    x, w = _operands(n, m, seed=m + n)
    truth = x.double() @ w.double().t()
    torch_err = (torch.mm(x, w.t()).double() - truth).abs().max().item()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm.mm(x, w, out)
    err = (out.double() - truth).abs().max().item()
    assert err <= 2 * torch_err + ATOL, (choice.chosen, err, torch_err)
    again = torch.full_like(out, float("nan"))
    gemm.mm(x, w, again)
    assert torch.equal(out, again)


# shapes where a cuBLASLt algorithm won by 10-30% on the H200 (bench/results/h200-cublaslt-algos.json), so the capture
# and sync checks run musekern's own cuBLASLt launch, not torch.mm
@pytest.mark.parametrize("n, m", [(4352, 65), (2176, 128), (8704, 24)])
def test_tuned_gemm_captures_and_never_syncs(n, m):
    choice = gemm.tune(n, [m], torch.cuda.current_device())[0]
    assert choice.chosen != "mm", choice
    x, w = _operands(n, m, seed=3)
    want = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    gemm.mm(x, w, want)
    out = torch.full_like(want, float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gemm.mm(x, w, out)  # eager: no host sync
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gemm.mm(x, w, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_prepare_tunes_the_gemm_path():
    n, m = 4352, 65  # TP4, the first M past the fused front
    dev = torch.cuda.current_device()
    assert not front._fused(n, m, dev)
    front.prepare(n, [m], num_kv_heads=2)
    tuned = {(c.n, c.m, c.device): c for c in gemm.choices()}
    assert (n, m, dev) in tuned and tuned[(n, m, dev)].us


# every algorithm the heuristic offers, not only the kept one: tuning rejects a wrong one, this says none is offered
@pytest.mark.parametrize("n, m", [(2176, 49), (4352, 65), (17408, 100)])
def test_every_cublaslt_candidate_matches_fp64(n, m):
    dev = torch.cuda.current_device()
    torch.mm(torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16), torch.zeros(8, 8, device="cuda",
                                                                                 dtype=torch.bfloat16))
    mat = cublaslt.Matmul(cublaslt.library(), n, m, dev)
    cands = mat.candidates()
    assert len(cands) >= 4 and len({c.algo for c in cands}) == len(cands)
    x, w = _operands(n, m, seed=11)
    truth = x.double() @ w.double().t()
    torch_err = (torch.mm(x, w.t()).double() - truth).abs().max().item()
    for c in cands:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        ws = torch.empty(max(c.workspace, 1), dtype=torch.uint8, device="cuda")
        mat.launcher(c)(w.data_ptr(), x.data_ptr(), out.data_ptr(), ws.data_ptr(),
                        torch.cuda.current_stream().cuda_stream)
        err = (out.double() - truth).abs().max().item()
        assert err <= 2 * torch_err + ATOL, (c.name, err, torch_err)


def test_a_misaligned_view_takes_torch_mm_bit_for_bit():
    n, m = 4352, 65
    assert gemm.tune(n, [m], torch.cuda.current_device())[0].chosen != "mm"
    x0, w = _operands(n, m, seed=5)
    store = torch.empty(m * gemm.HIDDEN + 8, dtype=torch.bfloat16, device="cuda")
    x = store[8:].view(m, gemm.HIDDEN)  # 16 bytes into its storage: not the 256 bytes cuBLASLt's heuristic assumed
    x.copy_(x0)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm.mm(x, w, out)
    assert torch.equal(out, torch.mm(x, w.t()))


# ---------------------------------------------------------------- the tuning record (gemm/records.py)
@pytest.fixture
def fresh_process(tmp_path, monkeypatch):
    """A cache of our own (MUSEKERN_CACHE_DIR) and this process's tuning forgotten, as in a new process; `timed`
    counts the candidates `tune` times."""
    from musekern.store.cache import Cache

    cache = Cache(tmp_path / "cache")
    cache.base.mkdir(parents=True)
    monkeypatch.setenv("MUSEKERN_CACHE_DIR", str(cache.root))
    timed = []
    real = gemm._time
    monkeypatch.setattr(gemm, "_time", lambda call, W: timed.append(1) or real(call, W))

    def forget():
        monkeypatch.setattr(gemm, "_CHOICES", {})
        monkeypatch.setattr(gemm, "_RUNS", {})
        timed.clear()
    forget()
    return cache, timed, forget


def _scope(dev):
    from musekern.gemm import records

    p = torch.cuda.get_device_properties(dev)
    return records.scope(p.name, (p.major, p.minor), p.multi_processor_count, cublaslt.library().version)


# shapes whose pick is a cuBLASLt algorithm: unsplit (TP4 M = 65) and split-K with a workspace (TP8 M = 128)
@pytest.mark.parametrize("n, m", [(4352, 65), (2176, 128)])
def test_a_second_process_checks_the_recorded_pick_instead_of_timing(fresh_process, n, m):
    from musekern.gemm import records

    cache, timed, forget = fresh_process
    dev = torch.cuda.current_device()
    first = gemm.tune(n, [m], dev)[0]
    assert not first.recorded and timed and first.chosen != "mm", first
    rec = records.load(cache, _scope(dev))[(n, m)]
    assert rec.chosen == first.chosen and rec.us == first.us
    x, w = _operands(n, m, seed=7)
    y1 = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm.mm(x, w, y1)
    forget()
    again = gemm.tune(n, [m], dev)[0]
    assert again.recorded and not timed and again.chosen == first.chosen and (n, m, dev) in gemm._RUNS
    y2 = torch.full_like(y1, float("nan"))
    gemm.mm(x, w, y2)
    assert torch.equal(y1, y2)  # the same algorithm: the same bits


def test_a_record_cublaslt_no_longer_offers_is_timed_again(fresh_process):
    from musekern.gemm import records

    cache, timed, forget = fresh_process
    n, m, dev = 4352, 65, torch.cuda.current_device()
    us = {"mm": 30.0, "lt[forged]": 10.0}
    assert records.save(cache, _scope(dev), {(n, m): records.Record("lt[forged]", bytes(range(64)), 0, us)}) is None
    got = gemm.tune(n, [m], dev)[0]
    assert not got.recorded and timed and "lt[forged]" not in got.us
    assert records.load(cache, _scope(dev))[(n, m)].us == got.us  # the record now holds what was measured


def test_a_read_only_cache_keeps_no_record_and_still_tunes(fresh_process):
    import os

    from musekern.gemm import records

    cache, timed, forget = fresh_process
    os.chmod(cache.base, 0o555)
    try:
        got = gemm.tune(4352, [65], torch.cuda.current_device())[0]
    finally:
        os.chmod(cache.base, 0o755)
    assert timed and got.chosen == gemm.pick(got.us) and not records.tuning_dir(cache).exists()
