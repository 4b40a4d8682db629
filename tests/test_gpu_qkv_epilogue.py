"""qkv_epilogue on the GPU (marked `gpu`; run on the H200 against a cache built on the CPU machine).

Correctness is judged against an fp64 epilogue applied to the same bf16 y: the kernel's error must be at most 2x
the error of torch's own path (musekern.reference: fp32 math, one rounding) plus a tiny atol. y's v and gate
columns and every cache element outside the given slots must be bit-for-bit unchanged (caches poisoned with a
sentinel); the v cache rows must be y's v bits. Fresh random inputs per case.
"""
import ctypes
import sys

import pytest
import torch
from kv_layouts import paged_caches

from musekern.config import load_config
from musekern.kernels.qkv_epilogue.variant import (
    EPI_ROUNDS_VECTORS,
    EPI_SMALL_VECTORS,
    all_builds,
    epilogue_variant,
    epilogue_vectors,
)
from musekern.ops import qkv_epilogue as op
from musekern.reference import fused_qknorm_rope_kv_insert, rope_cos_sin_table

pytestmark = pytest.mark.gpu

HD = 64
EPS = 1e-5
SENTINEL = -7.0  # exact in bf16: a cache element that still holds it was never written
ATOL = 1e-3
MODEL = load_config()
ALL_BUILDS = list(all_builds())
SHARDS = {s.tp: s for s in MODEL.shards()}  # TP 8, 4, 2, 1: N = 2176, 4352, 8704, 17408 with nkv 1, 2, 4, 8


def problem(m, tp, layout="vllm", seed=0, block_size=16, max_pos=4096, pad_every=3):
    """y [M, N] bf16 (unit scale, as a GEMM of normed activations gives), positions with 0, max_pos - 1 and three
    out of range, slots with -1 padding every `pad_every`, the cache's last slot and one past it."""
    s = SHARDS[tp]
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = (torch.randn(m, s.n, device="cuda", generator=g) * 2).to(torch.bfloat16)
    pos = torch.randint(0, max_pos, (m,), device="cuda", generator=g)
    pos[:5] = torch.tensor([0, max_pos - 1, -3, max_pos + 5, 2**40], device="cuda")[:m]
    num_blocks = (m + 40) // block_size + 1
    cap = num_blocks * block_size
    slots = torch.randperm(cap, device="cuda", generator=g)[:m]
    if pad_every:
        slots[::pad_every] = -1
    if m >= 3:
        slots[slots == cap - 1] = -1
        slots[1], slots[2] = cap - 1, cap + 7  # the last slot; past the end (writes nothing)
    kc, vc, backing = paged_caches(num_blocks, block_size, s.num_kv_heads, layout, SENTINEL, "cuda")
    return dict(y=y, positions=pos, cos_sin_cache=rope_cos_sin_table(max_pos, MODEL.rope_theta, "cuda"),
                slot_mapping=slots, key_cache=kc, value_cache=vc, num_kv_heads=s.num_kv_heads, eps=EPS), backing


def truth64(y, pos, cs, nkv):
    """The epilogue in float64 on the same bf16 y: (y, k rows, v rows)."""
    m, n = y.shape
    heads = n // HD
    nq = (heads - 2 * nkv) // 2
    t = y.double().reshape(m, heads, HD)
    qk = t[:, :nq + nkv]
    qk = qk / torch.sqrt(qk.pow(2).mean(-1, keepdim=True) + EPS)
    c = cs.double()[pos.clamp(0, cs.shape[0] - 1)]
    cos, sin = c[:, None, :HD // 2], c[:, None, HD // 2:]
    a, b = qk[..., 0::2], qk[..., 1::2]
    t[:, :nq + nkv] = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).reshape(m, nq + nkv, HD)
    return t.reshape(m, n), t[:, nq:nq + nkv], t[:, nq + nkv:nq + 2 * nkv]


def _slots(cache, slots):
    nb, bs = cache.shape[0], cache.shape[1]
    valid = (slots >= 0) & (slots < nb * bs)
    toks = valid.nonzero().flatten()
    s = slots[toks]
    return toks, s // bs, s % bs


def run(p):
    """The checked op on a poisoned-free copy: returns y (in place)."""
    return op.qkv_epilogue(**p)


def check(p, y_in, record_property=None):
    """p: the problem after the kernel ran (p["y"] rewritten); y_in: its y before."""
    y, nkv = p["y"], p["num_kv_heads"]
    m, n = y.shape
    nq = (n // HD - 2 * nkv) // 2
    qk = (nq + nkv) * HD
    assert torch.equal(y[:, qk:], y_in[:, qk:]), "v or gate columns of y changed"
    ty, tk, tv = truth64(y_in, p["positions"], p["cos_sin_cache"], nkv)
    kc_ref, vc_ref = p["key_cache"].clone(), p["value_cache"].clone()
    y_ref = fused_qknorm_rope_kv_insert(y_in, p["positions"], p["cos_sin_cache"], p["slot_mapping"], kc_ref, vc_ref,
                                        nkv, EPS)
    errs = {"y": ((y[:, :qk].double() - ty[:, :qk]).abs().max().item(),
                  (y_ref[:, :qk].double() - ty[:, :qk]).abs().max().item())}
    toks, blk, off = _slots(p["key_cache"], p["slot_mapping"])
    for name, cache, ref in (("key_cache", p["key_cache"], kc_ref), ("value_cache", p["value_cache"], vc_ref)):
        untouched = torch.ones(cache.shape[:2], dtype=torch.bool, device="cuda")
        untouched[blk, off] = False
        assert bool((cache[untouched] == SENTINEL).all()), f"{name}: written outside the given slots"
        assert torch.equal(cache, ref) or name == "key_cache", f"{name}: not the v bits of y at the slots"
    if toks.numel():
        k_rows = p["key_cache"][blk, off].double()
        errs["key_cache"] = ((k_rows - tk[toks]).abs().max().item(),
                             (kc_ref[blk, off].double() - tk[toks]).abs().max().item())
        assert torch.equal(p["value_cache"][blk, off], y_in[toks, qk:qk + nkv * HD].view(-1, nkv, HD))
    for name, (e_k, e_t) in errs.items():
        if record_property:
            record_property(f"{name}_err", e_k)
            record_property(f"{name}_torch_err", e_t)
        assert e_k <= 2 * e_t + ATOL, f"{name}: kernel error {e_k:.3e} > 2 x torch's {e_t:.3e} + {ATOL}"


def rule_edges():
    """(tp, M) on both sides of the rule's edges: small -> large build, one round -> two."""
    out = []
    for tp, s in SHARDS.items():
        for bound in (EPI_SMALL_VECTORS, EPI_ROUNDS_VECTORS):
            edge = bound // epilogue_vectors(1, s.n, s.num_kv_heads)
            out += [(tp, edge), (tp, edge + 1)]
    return out


# The M grid at every planned N. Edges it hits (threads a row: 8 per head group, H = nq + 2 nkv heads, groups
# of 1 (small build) or 2 (large build) heads; 256 threads a CTA): M = 1 a fraction of one CTA; 8 / 16 / 17 / 32 / 33
# / 64 / 65 the front's tile edges (one token tile, MAX_TOKENS, one past); 24, 31, 48, 100, 255 rows that end mid-CTA
# (TP8: 144 threads a row in the small build, 16 rows = 9 CTAs exactly; 72 in the large one, 32 rows = 9 CTAs);
# 128, 256, 1000 beyond one wave of the small build at TP1 (1152 threads a row: one wave of 132 SMs x 8 CTAs is 235
# rows); 4096, 16384, 65536 many waves of the large build (5 CTAs a SM: TP8 2346 rows a wave, TP1 293);
# rule_edges() both sides of each build switch per N. Both cache layouts alternate over M.
M_GRID = [1, 8, 16, 17, 24, 31, 32, 33, 48, 64, 65, 100, 128, 255, 256, 1000, 4096, 16384, 65536]
CASES = [(tp, m) for tp in (8, 4, 2, 1) for m in M_GRID] + rule_edges()


@pytest.mark.parametrize("tp,m", CASES)
def test_every_m_every_planned_n(record_property, tp, m):
    layout = ("vllm", "flashinfer")[(M_GRID.index(m) if m in M_GRID else m) % 2]
    p, _ = problem(m, tp, layout=layout, seed=1000 * tp + m)
    y_in = p["y"].clone()
    run(p)
    torch.cuda.synchronize()
    record_property("build", epilogue_variant(p["y"].shape[1], m, p["num_kv_heads"]).label)
    check(p, y_in, record_property)


# vecs_per_thread and rounds change only which thread does what: every build gives the bits of the planned one, and
# one build gives the same bits on every run (no atomics, no timing dependence). TP8 (partial head groups at 4 and 8),
# TP4, TP2 and TP1, a single row, a row count that ends mid-CTA in every build, and many waves.
@pytest.mark.parametrize("tp,m", [(8, 1), (8, 1000), (8, 4096), (4, 33), (2, 999), (1, 17), (1, 4096)])
def test_every_build_gives_identical_bits(tp, m):
    p, backing = problem(m, tp, layout="flashinfer", seed=7 + m)
    y_in, kv_in = p["y"].clone(), backing.clone()
    results = []
    for b in ALL_BUILDS:
        for _ in range(2):
            p["y"].copy_(y_in)
            backing.copy_(kv_in)
            op.launch(**p, variant=b)
            results.append((p["y"].clone(), backing.clone()))
    torch.cuda.synchronize()
    check(p, y_in)  # the last launch is right
    for y, kv in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(kv, results[0][1])


def _mm_epilogue(x, w, p):
    torch.mm(x, w.t(), out=p["y"])
    op.qkv_epilogue(**p)


# Capture torch.mm + the epilogue once, then replay with new x, positions and slots copied into the captured
# buffers: every replay equals an eager run on the same inputs, bit for bit. Both builds (M = 1, 17 small; 4096
# large at TP8), and TP4.
@pytest.mark.parametrize("tp,m", [(8, 1), (8, 17), (8, 4096), (4, 64)])
def test_graph_capture_and_replay_with_new_inputs(tp, m):
    s = SHARDS[tp]
    g = torch.Generator(device="cuda").manual_seed(tp + m)
    w = (torch.randn(s.n, MODEL.hidden_size, device="cuda", generator=g) / MODEL.hidden_size ** 0.5).to(torch.bfloat16)
    p, backing = problem(m, tp, seed=3)
    op.prepare(s.n, [m], num_kv_heads=s.num_kv_heads)
    x = torch.randn(m, MODEL.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        _mm_epilogue(x, w, p)  # warm-up on the capture stream (cuBLAS workspace)
        with torch.cuda.graph(graph, stream=side):
            _mm_epilogue(x, w, p)
    torch.cuda.current_stream().wait_stream(side)
    for rep in range(3):
        q, _ = problem(m, tp, seed=100 + rep)
        x_new = torch.randn(m, MODEL.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
        kv0 = backing.clone()
        # eager on copies of the same inputs
        e = dict(p, y=torch.empty_like(p["y"]), positions=q["positions"], slot_mapping=q["slot_mapping"])
        eb = kv0.clone()
        e["key_cache"], e["value_cache"] = eb[0], eb[1]
        _mm_epilogue(x_new, w, e)
        # replay on the captured buffers
        x.copy_(x_new)
        p["positions"].copy_(q["positions"])
        p["slot_mapping"].copy_(q["slot_mapping"])
        p["y"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(p["y"], e["y"]) and torch.equal(backing, eb)


def test_no_host_sync_kernel_or_reference():
    """The checked op (both builds) and the vectorized reference on GPU tensors never synchronize the host."""
    cases = [problem(m, 8, seed=m)[0] for m in (1, 64, 4096)]
    for p in cases:
        op.prepare(p["y"].shape[1], [p["y"].shape[0]], num_kv_heads=1)
    empty, _ = problem(0, 8, pad_every=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for p in cases:
            op.qkv_epilogue(**p)
            fused_qknorm_rope_kv_insert(p["y"], p["positions"], p["cos_sin_cache"], p["slot_mapping"],
                                        p["key_cache"], p["value_cache"], 1, EPS)
        assert op.qkv_epilogue(**empty) is empty["y"]  # M = 0: nothing launched
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_tensors_on_two_devices_are_refused():
    p, _ = problem(4, 8)
    p["positions"] = p["positions"].cpu()
    assert op.unsupported(**p) == "positions is on cpu, y on cuda:0: all tensors must be on one CUDA device"


# ---------------------------------------------------------------- PDL
PRED_SRC = r"""
// Lets its dependents launch at once, waits ~spin_ns, and only then writes y: an epilogue that read y before
// griddepcontrol.wait would see the old y.
extern "C" __global__ void pred_write_y(unsigned short* y, const unsigned short* src, int n, long long spin_ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)spin_ns);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = src[i];
}
"""


def test_pdl_epilogue_sees_the_y_its_predecessor_writes():
    """50 times: the predecessor triggers its dependents at once, spins, then writes y; the epilogue (launched with
    PDL, so it may start while the predecessor spins) must work on the new y."""
    from bench.harness.pred import _BuiltKernel

    try:
        pred = _BuiltKernel("sm_90a", PRED_SRC, "pred_write_y.cu", "pred_write_y")
    except RuntimeError as e:
        pytest.skip(f"no NVRTC / nvcc for the predecessor: {e}")
    m, tp = 64, 8
    p, backing = problem(m, tp, seed=21)
    srcs = [torch.randn(m, SHARDS[tp].n, device="cuda").to(torch.bfloat16) for _ in range(2)]
    kv0 = backing.clone()
    expect = []
    for src in srcs:
        p["y"].copy_(src)
        backing.copy_(kv0)
        expect.append((run(p).clone(), backing.clone()))
    for i in range(50):
        p["y"].copy_(srcs[1 - i % 2])  # the stale y
        backing.copy_(kv0)
        vals = [ctypes.c_uint64(p["y"].data_ptr()), ctypes.c_uint64(srcs[i % 2].data_ptr()),
                ctypes.c_int(p["y"].numel()), ctypes.c_longlong(20_000)]
        pred._launch((8, 1, 1), (256, 1, 1), vals, False, "pred_write_y")
        run(p)
        torch.cuda.synchronize()
        assert torch.equal(p["y"], expect[i % 2][0]) and torch.equal(backing, expect[i % 2][1]), f"iteration {i}"


def test_no_cutlass_on_the_launch_path():
    assert "cutlass" not in sys.modules
