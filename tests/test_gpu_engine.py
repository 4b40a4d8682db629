"""The ops in an engine, on the GPU (marked `gpu`): opcheck on CUDA tensors, inductor (fullgraph, dynamic M, the
caches written in place), mode="reduce-overhead" (CUDA graphs), a hand-captured torch.cuda.graph after
`prepare`, and the decoder attention block of examples/decode_attention.py in a multi-request run against the
float32 oracle (tests/engine_scenario.py).

`qkv_front_auto` serves every M on the GPU (the fused front, or cuBLAS + the fused epilogue); should a build fall back
to the plain-torch reference (which syncs the host), the tests that capture such an M report xfail naming it (checked
before any capture is attempted), and the decode run records which path served its M > 16 steps.
"""
from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import torch
from engine_scenario import (
    EPS,
    Ops,
    Scheduler,
    cache_views,
    front_args,
    load_example,
    module_args,
    run_schedule,
    same,
    serve,
)
from torch._dynamo.testing import CompileCounterWithBackend

import musekern
import musekern.reference
from musekern.config import load_config
from musekern.ops import library
from musekern.ops import qkv_front as front_ops
from musekern.reference import rope_cos_sin_table

pytestmark = pytest.mark.gpu

K, D = 8192, 64
SHARDS = {s.tp: s for s in load_config().shards()}
OPS = torch.ops.musekern
ISSUE_13 = "qkv_front_auto served this M with the plain-torch reference (host sync, not capturable)"


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    return {tp: (torch.randn(s.n, K, device="cuda", generator=g) / math.sqrt(K)).to(torch.bfloat16)
            for tp, s in SHARDS.items() if tp in (8, 4)}


@pytest.fixture
def no_tf32():
    """The float32 oracle must be float32 (torch's default; set here in case the process changed it)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev


def case(weights, m, tp=8, layout="vllm", num_blocks=64, block_size=16, max_pos=4096, seed=0, pad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = SHARDS[tp]
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=g)[:m]
    if pad:
        slots[1::4] = -1
    shape = (2, num_blocks, block_size, s.num_kv_heads, D) if layout == "vllm" else \
        (num_blocks, 2, block_size, s.num_kv_heads, D)
    return dict(x=torch.randn(m, K, device="cuda", generator=g).to(torch.bfloat16), weight=weights[tp],
                positions=torch.randint(0, max_pos, (m,), device="cuda", generator=g),
                cos_sin_cache=rope_cos_sin_table(max_pos, 1e6, "cuda"), slot_mapping=slots,
                kv=torch.full(shape, -7.0, dtype=torch.bfloat16, device="cuda"), layout=layout,
                num_kv_heads=s.num_kv_heads)


def refill(c, seed):
    """New values in the same input tensors (what a graph replay reads)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = c["x"].shape[0]
    kc = cache_views(c["kv"], c["layout"])[0]
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device="cuda", generator=g)[:m]
    slots[1::4] = -1
    c["x"].copy_(torch.randn(m, K, device="cuda", generator=g))
    c["positions"].copy_(torch.randint(0, c["cos_sin_cache"].shape[0], (m,), device="cuda", generator=g))
    c["slot_mapping"].copy_(slots)


def m_above_16_reason(weights, m) -> str | None:
    """None when an M > 16 call runs on the GPU without a host sync, else why not (checked eagerly, before any
    capture is attempted: a failed capture could leave the process's CUDA state unusable)."""
    c = case(weights, m)
    calls = []
    originals = {n: getattr(musekern.reference, n) for n in ("qkv_front_reference", "fused_qknorm_rope_kv_insert")}

    def spy(name):
        def f(*a, **k):
            calls.append(name)
            return originals[name](*a, **k)
        return f

    try:
        for n in originals:
            setattr(musekern.reference, n, spy(n))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        OPS.qkv_front(*front_args(c))
    except RuntimeError as e:
        return f"{ISSUE_13}: {str(e).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for n, f in originals.items():
            setattr(musekern.reference, n, f)
    return f"{ISSUE_13} (called {sorted(set(calls))})" if calls else None


# ---------------------------------------------------------------- prepare, then capture with nothing else loaded
def test_prepare_then_capture_without_a_warmup_call(weights, record_property):
    """First in this file: TP4 kernels loaded by `prepare` alone, then captured with no eager call of that shape
    before the capture (nothing may load inside a capture), replayed, compared with an eager call after it."""
    from musekern.runtime import loaded_kernels

    m, tp = 16, 4
    before = {k.label for k in loaded_kernels()}
    loaded = library.prepare(SHARDS[tp].n, [m], qk_norm_head_dims=(64,))
    assert len(loaded) >= 1 + 4
    record_property("loaded_by_prepare", json.dumps(sorted({k.label for k in loaded} - before)))
    c = case(weights, m, tp=tp, seed=1)
    mod = Ops()
    kv_e = c["kv"].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = mod(*module_args(c))
    want = mod(*module_args(c, kv_e))
    g.replay()
    torch.cuda.synchronize()
    assert same(got, want) and torch.equal(c["kv"], kv_e)


# ---------------------------------------------------------------- opcheck, the op is the kernel
@pytest.mark.parametrize("layout,m", [("vllm", 1), ("vllm", 8), ("flashinfer", 16), ("vllm", 17)])
def test_opcheck_qkv_front_cuda(weights, layout, m):
    torch.library.opcheck(OPS.qkv_front.default, front_args(case(weights, m, layout=layout)))


@pytest.mark.parametrize("m,scale", [(1, 1.0), (16, 0.125), (333, 1.0)])
def test_opcheck_qk_norm_cuda(m, scale):
    x = torch.randn(m, 2176, device="cuda").to(torch.bfloat16)[:, :1024]  # strided rows of a fused projection
    torch.library.opcheck(OPS.qk_norm.default, (x, 64, EPS, scale))


@pytest.mark.parametrize("m", [1, 5, 16])
def test_op_is_the_checked_kernel_bitwise_with_no_host_sync(weights, m):
    c = case(weights, m, seed=m)
    kv_k = c["kv"].clone()
    want = musekern.qkv_front(*front_args(c, kv_k))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = OPS.qkv_front(*front_args(c))
        q = OPS.qk_norm(got[:, :1024], 64, EPS, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want) and torch.equal(c["kv"], kv_k)
    assert torch.equal(q, musekern.qk_norm(want[:, :1024], 64, EPS, 0.5))


# ---------------------------------------------------------------- inductor
def test_inductor_fullgraph_bitwise_in_place_and_one_graph_for_every_m(weights, record_property):
    """Zero graph breaks; the compiled layer equals eager bit for bit; the caches are written in place (no clone
    or copy in the generated code); mark_dynamic M: one graph for M = 2..16 and above (the M > 16 path is inside
    the op), one more for M = 1 (torch specializes sizes 0/1 of backed dynamic dims)."""
    from torch._inductor.utils import run_and_get_code

    mod = Ops()
    c = case(weights, 5)
    explain = torch._dynamo.explain(mod)(*module_args(c, c["kv"].clone()))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(mod, backend=cnt, fullgraph=True)
    for i, m in enumerate([2, 3, 8, 9, 16, 17, 64, 1]):
        c = case(weights, m, seed=10 + i)
        for t in (c["x"], c["positions"], c["slot_mapping"]):
            torch._dynamo.mark_dynamic(t, 0)
        kv_e = c["kv"].clone()
        want = mod(*module_args(c, kv_e))
        if i == 0:
            got, codes = run_and_get_code(compiled, *module_args(c))
            code = "\n".join(codes)
            record_property("code_lines", json.dumps([ln.strip()[:200] for ln in code.splitlines()
                                                      if any(w in ln for w in ("musekern", "clone", "copy_"))]))
            assert "musekern.qkv_front.default(" in code
            assert "clone" not in code and "copy_" not in code, "inductor copies a cache around the op"
        else:
            got = compiled(*module_args(c))
        assert same(got, want) and torch.equal(c["kv"], kv_e), f"M={m}"
        assert cnt.frame_count == (1 if m > 1 else 2), f"M={m}: {cnt.frame_count} graphs"


# ---------------------------------------------------------------- CUDA graphs
class OpsLayer(torch.nn.Module):
    """A layer owning its weights and the cache (static addresses: what CUDA graphs need)."""

    def __init__(self, weight, kv, cos_sin_cache):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("kv", kv)
        self.register_buffer("cos_sin_cache", cos_sin_cache)

    def forward(self, x, positions, slot_mapping):
        kc, vc = self.kv[0], self.kv[1]
        y = OPS.qkv_front(x, self.weight, positions, self.cos_sin_cache, slot_mapping, kc, vc, kc.shape[2], EPS)
        return y, OPS.qk_norm(y[:, :1024], 64, EPS, 0.125)


@pytest.mark.parametrize("m", [8, 24])
def test_reduce_overhead_replays_without_python_and_matches_eager(weights, monkeypatch, m):
    if m > 16 and (why := m_above_16_reason(weights, m)):
        pytest.xfail(why)
    grab = _CudagraphLog()
    log = torch._logging.getArtifactLogger("torch._inductor.cudagraph_utils", "cudagraphs")
    log.addHandler(grab)
    torch._logging.set_logs(cudagraphs=True)  # where inductor says why it skips CUDA graphs
    try:
        _reduce_overhead(weights, monkeypatch, m, grab)
    finally:
        torch._logging.set_logs()
        log.removeHandler(grab)


class _CudagraphLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.msgs = []

    def emit(self, record):
        msg = record.getMessage()
        if "cudagraph" in msg.lower():
            self.msgs.append(msg[:300])


def _reduce_overhead(weights, monkeypatch, m, grab):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    c = case(weights, m, seed=100)
    layer = OpsLayer(c["weight"], c["kv"], c["cos_sin_cache"])
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    calls = []
    impl = front_ops.qkv_front_auto
    monkeypatch.setattr(front_ops, "qkv_front_auto", lambda *a: calls.append(1) or impl(*a))
    for i in range(6):
        refill(c, seed=200 + i)
        kv0 = layer.kv.clone()
        want = [t.clone() for t in layer(c["x"], c["positions"], c["slot_mapping"])]
        kv_want = layer.kv.clone()
        layer.kv.copy_(kv0)
        before = len(calls)
        got = [t.clone() for t in compiled(c["x"], c["positions"], c["slot_mapping"])]
        assert same(got, want) and torch.equal(layer.kv, kv_want), f"call {i}"
        replayed = len(calls) == before
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"CUDA graphs skipped: {grab.msgs}"
    assert replayed, "the last call ran the op's Python: no CUDA graph replay"


@pytest.mark.parametrize("m", [1, 8, 16, 24, 300])
def test_manual_capture_after_prepare(weights, m):
    if m > 16 and (why := m_above_16_reason(weights, m)):
        pytest.xfail(why)
    library.prepare(SHARDS[8].n, [m], qk_norm_head_dims=(64,))
    c = case(weights, m, seed=300)
    mod = Ops()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            out = mod(*module_args(c))
    torch.cuda.current_stream().wait_stream(s)
    for i in range(3):
        refill(c, seed=400 + i)
        kv_e = c["kv"].clone()
        want = mod(*module_args(c, kv_e))
        for t in out:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert same(out, want) and torch.equal(c["kv"], kv_e), f"replay {i}"


# ---------------------------------------------------------------- the decoder attention block
# The run: a 300-token prefill of 4 requests (padded to 512: the M > 16 path), then 40 decode steps whose batch
# grows to 24 requests (joins prefill their 1..24-token prompts in the same step), shrinks to 1 and grows again:
# decode-only steps at M = 1..16 and above 16, every third step padded to a graph bucket with slot -1 tokens,
# blocks of 16 slots handed out from a shuffled free list and reused after requests leave.
DECODE_SIZES = [4, 4, 3, 5, 8, 8, 12, 16, 16, 17, 20, 20, 24, 24, 19, 16, 16, 13, 9, 9, 6, 4, 2, 1, 1, 1, 2, 3, 5,
                7, 8, 11, 15, 16, 17, 12, 10, 6, 3, 1]


@pytest.mark.parametrize("layout", ["vllm", "flashinfer"])
def test_decode_run_matches_the_float32_oracle(record_property, no_tf32, layout):
    syncs = {}

    def watch(st, call):  # which steps synced the host (the block itself must not; the front at M > 16 today does)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[len(syncs)] = any("synchroniz" in str(w.message) for w in caught)
        return out

    recs = serve("cuda", layout, [97, 150, 33, 20], DECODE_SIZES, num_blocks=256, block_size=16, max_blocks=16,
                 on_step=watch)
    for i, r in enumerate(recs):
        r["host_sync"] = syncs[i]
    record_property("steps", json.dumps(recs))
    record_property("max_err", max(r["err"] for r in recs))
    record_property("max_err_over_bound", max(r["err"] / r["bound"] for r in recs))
    above = [r for r in recs if r["real"] > 16]
    record_property("m_above_16_path", "reference (host sync)" if any(r["host_sync"] for r in above) else "gpu")
    decode_only = {r["real"] for r in recs if r["prefill_tokens"] == 0}
    assert recs[0]["real"] == 300 and len(recs) == 41
    assert 1 in decode_only and decode_only & set(range(2, 17)) and max(decode_only) > 16
    for i, r in enumerate(recs):
        assert r["finite"] and r["untouched_ok"], f"step {i}: {r}"
        assert r["err"] <= r["bound"], f"step {i} (M={r['m']}): error {r['err']:.3g} > bound {r['bound']:.3g}"
        assert r["torch_err"] <= 4 * 2.0 ** -8 * r["scale"], f"step {i}: torch's own block is off: {r}"
        if r["real"] <= 16:
            assert not r["host_sync"], f"step {i} (M={r['m']}) synced the host"


def test_decode_block_step_in_a_cuda_graph():
    """A decode step of the whole block (front, paged attention, gate, o_proj) captured once and replayed for
    later steps of the same shape, against the eager block with its own copy of the cache."""
    ex = load_example()
    kw = dict(num_blocks=64, block_size=16, device="cuda")
    eager = ex.DecoderAttentionBlock.for_config(seed=7, **kw)
    graphed = ex.DecoderAttentionBlock.for_config(seed=7, **kw)
    sched = Scheduler(64, 16, 8, seed=7)
    steps = [st for st, _ in run_schedule(sched, [40, 3, 9, 17, 5, 2, 1, 30], [8] * 4, pad_every=99)]
    prefill = steps[0].inputs("cuda")  # eagerly in both
    eager(*prefill)
    graphed(*prefill)
    library.prepare(SHARDS[8].n, [8], qk_norm_head_dims=(64,))
    static = steps[1].inputs("cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (cuBLAS, SDPA) writes the same rows step 1 writes
        graphed(*static)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = graphed(*static)
    torch.cuda.current_stream().wait_stream(s)
    for st in steps[1:]:
        assert st.m == 8
        for dst, src in zip(static, st.inputs("cuda"), strict=True):
            dst.copy_(src)
        want = eager(*st.inputs("cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(graphed.kv, eager.kv), f"positions {st.positions.tolist()}"


def test_first_step_of_reduce_overhead_layer_in_fresh_processes(tmp_path):
    """Issue 26: the first step (CUDA-graph trees' warm-up) of a reduce-overhead layer holding its caches as buffers
    equals its eager twin bit for bit, in fresh processes; the first of them launches its kernel for the first time in
    that step (--cold). A small run of bench/first_step_stress.py (the full one: bench/results/
    h200-first-step-stress.json)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "first_step_stress.py"
    out = tmp_path / "fs.json"
    r = subprocess.run([sys.executable, str(script), "--procs", "4", "--parallel", "4", "--trials", "2", "--cold",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    summary = json.loads(out.read_text())["summary"]
    assert r.returncode == 0 and summary["processes"] == 4 and summary["errors"] == 0, r.stdout + r.stderr
    assert summary["first_step_differs"] == summary["later_step_differs"] == summary["other_differs"] == 0, summary
