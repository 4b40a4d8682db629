"""The decoder attention block of examples/decode_attention.py on CPU (the ops' CPU kernels): a multi-request run
against the float32 oracle, and the block under torch.compile(fullgraph=True). The GPU run is in
tests/test_gpu_engine.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_scenario import Scheduler, load_example, run_schedule, serve  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

ex = load_example()


def test_multi_request_run_matches_the_float32_oracle():
    # small: a 33-token prefill of two requests (above 16: the M > 16 path), then 8 decode steps whose batch
    # grows (joins prefill in the same step), shrinks to one request and grows again; 4-token blocks so every
    # request spans several shuffled blocks and reuses blocks others left
    recs = serve("cpu", "vllm", [24, 9], [2, 3, 1, 1, 4, 2, 1, 2], num_blocks=48, block_size=4, max_blocks=16)
    assert recs[0]["real"] == 33 and recs[0]["m"] == 48  # padded prefill
    assert {r["real"] for r in recs[1:]} >= {1, 2}
    for i, r in enumerate(recs):
        assert r["finite"] and r["untouched_ok"], f"step {i}: {r}"
        assert r["err"] <= r["bound"], f"step {i}: error {r['err']:.3g} > bound {r['bound']:.3g}"
        # torch's own bf16 block: about one bf16 rounding per stage at the output's scale
        assert r["torch_err"] <= 4 * 2.0 ** -8 * r["scale"], f"step {i}: {r}"


def test_a_read_of_an_unwritten_row_misses_the_bound_by_far():
    """Negative control: the same step with one block-table entry pointing at a block the front never wrote
    (poisoned) is far outside the bound the real run meets."""
    from engine_scenario import SENTINEL, DenseFloat32Block, bf16_bound

    blk = ex.DecoderAttentionBlock.for_config(num_blocks=16, block_size=4)
    blk.kv.fill_(SENTINEL)
    st, _ = next(run_schedule(Scheduler(16, 4, 4, seed=5), [6, 3], []))
    w = ex.AttentionWeights(blk.norm_weight, blk.qkv_weight, blk.o_weight)
    want = DenseFloat32Block(w, blk.nq, blk.nkv, blk.cos_sin_cache, blk.qk_eps, blk.rms_eps).step(st, "cpu")
    hidden, pos, slots, tables, req = st.inputs("cpu")
    good = blk(hidden, pos, slots, tables, req)[:st.real].float()
    unused = sorted(set(range(16)) - set(tables.flatten().tolist()))[0]
    bad_tables = tables.clone()
    bad_tables[0, 0] = unused
    bad = blk(hidden, pos, slots, bad_tables, req)[:st.real].float()
    scale = want.abs().max().item()
    bound = bf16_bound((good - want).abs().max().item(), scale)
    assert (good - want).abs().max().item() <= bound
    assert (bad - want).abs().max().item() > 10 * bound


def test_block_compiles_fullgraph_and_matches_eager_bitwise():
    blk = ex.DecoderAttentionBlock.for_config(num_blocks=32, block_size=4)
    sched = Scheduler(32, 4, 8, seed=3)
    steps = [st for st, _ in run_schedule(sched, [7, 3], [2, 3, 3])]
    explain = torch._dynamo.explain(blk)(*steps[0].inputs("cpu"))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    blk.kv.zero_()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(blk, backend=cnt, fullgraph=True)
    for st in steps:
        args = st.inputs("cpu")
        for t in args:  # M, and the number of requests (block_tables rows)
            torch._dynamo.mark_dynamic(t, 0)
        kv0 = blk.kv.clone()
        want = blk(*args)
        kv_want = blk.kv.clone()
        blk.kv.copy_(kv0)
        got = compiled(*args)
        assert torch.equal(got, want) and torch.equal(blk.kv, kv_want), f"M={st.m}"
    assert cnt.frame_count == 1, [st.m for st in steps]
