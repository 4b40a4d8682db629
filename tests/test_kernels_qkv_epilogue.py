"""qkv_epilogue CuTe DSL kernel on CPU: the unit mapping's intended math against the reference, then compiles
(sm_90a every build, sm_100a), the ABI against the PTX `.entry`, the PTX and SASS the design relies on (16-byte
global loads and stores, no local memory, the y loads issued before the first shuffle, PDL), determinism.

The compile tests need nvidia-cutlass-dsl (the `build` extra); the SASS ones cuobjdump/nvdisasm (pip wheels).
"""
from __future__ import annotations

import re

import nvdump
import pytest
from kv_layouts import paged_caches

from musekern.kernels.qkv_epilogue.variant import (
    EPI_BLOCK,
    EPI_CTAS_PER_SM,
    EPI_LANES,
    QkvEpilogueVariant,
    all_builds,
    head_counts,
    launch_grid,
    row_units,
)
from musekern.store.abi import KernelAbi, check_abi_against_ptx, cubin_arch

torch = pytest.importorskip("torch")

from musekern.reference import fused_qknorm_rope_kv_insert, rope_cos_sin_table  # noqa: E402

ALL = list(all_builds())
PARAM_NAMES = ["y", "positions", "cos_sin_cache", "slot_mapping", "key_cache", "value_cache", "M", "num_q_heads",
               "num_kv_heads", "ld_y", "max_pos", "block_size", "num_blocks", "k_block_stride", "v_block_stride", "eps"]
EPS = 1e-5


# ---------------------------------------------------------------- the intended math, on CPU
def grid_units(v, m, n, nkv):
    """(live, w clamped to the last unit) of every unit index the grid's threads take in their rounds (round k: thread
    t's unit t + k G, G the grid's threads); a unit past the end works on the last one."""
    total = m * row_units(v, n, nkv)
    threads = launch_grid(v, m, n, nkv)[0] * EPI_BLOCK
    w = (torch.arange(v.rounds)[:, None] * threads + torch.arange(threads)).reshape(-1)
    return w < total, w.clamp(max=total - 1)


def simulate(y, positions, cs, slots, kc, vc, nkv, eps, v):
    """Runs the kernel's unit mapping (the formulas of kernels/qkv_epilogue.py), vectorized over the units every
    thread of the grid works on in its rounds, on CPU: returns the new y, and counts of how often each element of y
    and of the caches is written."""
    m, n = y.shape
    nq, _ = head_counts(n, nkv)
    heads = nq + 2 * nkv
    vpt = v.vecs_per_thread
    ru = row_units(v, n, nkv)
    live, wc = grid_units(v, m, n, nkv)
    r, rem = wc // ru, wc % ru
    j, h0 = rem % EPI_LANES, (rem // EPI_LANES) * vpt
    # the 8 lanes of a (row, head group) are consecutive and 8-aligned, and all live or all dead
    for t in (r, h0, live):
        assert bool((t.view(-1, EPI_LANES) == t.view(-1, EPI_LANES)[:, :1]).all())
    assert bool((j[live].view(-1, EPI_LANES) == torch.arange(EPI_LANES)).all())
    p = positions[r].clamp(0, cs.shape[0] - 1)
    cols4 = 4 * j[:, None] + torch.arange(4)
    cos, sin = cs[p[:, None], cols4], cs[p[:, None], 32 + cols4]
    nb, bs = kc.shape[0], kc.shape[1]
    s = slots[r]
    cached = live & (s >= 0) & (s < nb * bs)
    s32 = s.clamp(0, nb * bs - 1)
    blk, off = s32 // bs, s32 % bs
    out = y.clone()
    y_writes = torch.zeros(m, n, dtype=torch.int32)
    k_writes = torch.zeros(kc.shape, dtype=torch.int32)
    v_writes = torch.zeros(vc.shape, dtype=torch.int32)
    cols8 = 8 * j[:, None] + torch.arange(8)
    for u in range(vpt):
        h = h0 + u
        hl = h.clamp(max=heads - 1)  # a head past the last v head loads the last v head (never stored)
        vec = y[r[:, None], hl[:, None] * 64 + cols8]
        assert bool((r < m).all() and (hl * 64 + 63 < n).all())  # every load in bounds
        xf = vec.float()
        ss = (xf * xf).sum(-1).view(-1, EPI_LANES).sum(-1).repeat_interleave(EPI_LANES)
        rs = torch.rsqrt(ss / 64 + eps)[:, None]
        a, b = xf[:, 0::2] * rs, xf[:, 1::2] * rs
        o = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).reshape(-1, 8).to(torch.bfloat16)
        st = live & (h < nq + nkv)
        out[r[st][:, None], h[st][:, None] * 64 + cols8[st]] = o[st]
        y_writes.index_put_((r[st][:, None], h[st][:, None] * 64 + cols8[st]), torch.tensor(1, dtype=torch.int32),
                            accumulate=True)
        for cache, writes, lo, hi, val in ((kc, k_writes, nq, nq + nkv, o), (vc, v_writes, nq + nkv, heads, vec)):
            sel = cached & (h >= lo) & (h < hi)
            idx = (blk[sel][:, None], off[sel][:, None], (h[sel] - lo)[:, None], cols8[sel])
            cache[idx] = val[sel]
            writes.index_put_(idx, torch.tensor(1, dtype=torch.int32), accumulate=True)
    return out, y_writes, k_writes, v_writes


def _case(m, n, nkv, layout, seed, num_blocks=5, block_size=4, max_pos=40):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(m, n, generator=g) * 2).to(torch.bfloat16)
    pos = torch.randint(-3, max_pos + 3, (m,), generator=g)  # some out of range: clamped
    cap = num_blocks * block_size
    slots = torch.randperm(cap, generator=g)[:m] if m <= cap else torch.arange(m) % (cap + 7)
    slots = slots.clone()
    seen = set()  # the valid slots distinct (two tokens on one slot are undefined)
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < cap and s in seen:
            slots[t] = -1
        seen.add(s)
    slots[::3] = -1  # padding
    for t, s in ((1, cap + 2), (4, cap - 1)):  # past the cache; the last slot
        if t < m:
            slots[slots == s] = -1
            slots[t] = s
    kc, vc, _ = paged_caches(num_blocks, block_size, nkv, layout)
    return y, pos, rope_cos_sin_table(max_pos, 10000.0), slots, kc, vc


# Every build; TP8's and TP4's layouts (partial head groups at vpt 4 and 8), the smallest layout (N = 256, H = 3 <
# vpt 4), rows that end mid-CTA; both cache layouts; padding, a slot past the cache, the last slot.
@pytest.mark.parametrize("v", ALL, ids=lambda v: v.label)
@pytest.mark.parametrize("m,n,nkv,layout", [(1, 2176, 1, "vllm"), (7, 2176, 1, "flashinfer"), (33, 4352, 2, "vllm"),
                                            (5, 256, 1, "flashinfer"), (13, 1280, 2, "vllm")])
def test_intended_math_matches_reference(v, m, n, nkv, layout):
    y, pos, cs, slots, kc, vc = _case(m, n, nkv, layout, seed=v.vecs_per_thread * 100 + v.rounds * 10 + m)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = fused_qknorm_rope_kv_insert(y, pos, cs, slots, kc_ref, vc_ref, nkv, EPS)
    out, y_w, k_w, v_w = simulate(y, pos, cs, slots, kc, vc, nkv, EPS, v)
    nq, _ = head_counts(n, nkv)
    qk = (nq + nkv) * 64
    assert bool((y_w[:, :qk] == 1).all()) and bool((y_w[:, qk:] == 0).all()), "q, k once; v and gate never"
    assert torch.equal(out[:, qk:], y[:, qk:])
    # fp32 math, one rounding: within one bf16 ulp of the fp32 reference (summation order differs)
    assert torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=1e-6)
    valid = [(t, s) for t, s in enumerate(slots.tolist()) if 0 <= s < kc.shape[0] * kc.shape[1]]
    for writes in (k_w, v_w):
        assert int(writes.sum()) == len(valid) * nkv * 64 and int(writes.max()) <= 1
    assert torch.equal(vc, vc_ref)  # v: the loaded bits, bit for bit
    assert torch.allclose(kc.float(), kc_ref.float(), rtol=2 ** -7, atol=1e-6)


# ---------------------------------------------------------------- compile (needs the DSL)
_COMPILED: dict = {}


def _compile(v, arch="sm_90a"):
    pytest.importorskip("cutlass")
    if (v, arch) not in _COMPILED:
        from musekern.builder.compile import compile_variant

        _COMPILED[(v, arch)] = compile_variant(v, arch)
    return _COMPILED[(v, arch)]


def test_abi_for_is_pure_and_stable():
    from musekern.kernels.qkv_epilogue.abi import abi_for

    for v in ALL:
        abi = abi_for(v)
        assert [p.name for p in abi.params] == PARAM_NAMES
        assert [(p.kind, p.align, p.size) for p in abi.params] == (
            [("pointer", 8, 8)] * 6 + [("scalar", 4, 4)] * 7 + [("scalar", 8, 8)] * 2 + [("scalar", 4, 4)])
        assert abi.launch.block == (EPI_BLOCK, 1, 1) and abi.launch.cluster == (1, 1, 1)
        assert abi.launch.dynamic_smem_bytes == 0 and abi.launch.pdl and abi.tensormaps == ()
        assert KernelAbi.from_json(abi.to_json()) == abi


def _count(pattern, text):
    return len(re.findall(pattern, text, re.M))


def _check_ptx(ck, v, arch):
    assert ck.cubin[:4] == b"\x7fELF" and cubin_arch(ck.cubin) == arch
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    ptx = ck.ptx[ck.ptx.index(".entry " + ck.symbol):]
    vpt, rounds = v.vecs_per_thread, v.rounds
    # per round: y, vpt 16-byte loads; cos and sin, one 16-byte load each; position and slot, 8 bytes each. Stores:
    # y, key cache and value cache for each head (16 bytes each, predicated per head type). Before the first round,
    # an L2 prefetch of each later round's position, slot and y vectors.
    assert _count(r"^\s*(@%p\d+\s+)?ld\.global(\.\w+)*\.v4\.(b32|u32|f32)\s", ptx) == (vpt + 2) * rounds
    assert _count(r"^\s*(@%p\d+\s+)?ld\.global(\.\w+)*\.(b64|u64|s64)\s", ptx) == 2 * rounds
    assert _count(r"^\s*(@%p\d+\s+)?ld\.global", ptx) == (vpt + 4) * rounds
    assert _count(r"^\s*(@%p\d+\s+)?st\.global(\.\w+)*\.v4\.(b32|u32|f32)\s", ptx) == 3 * vpt * rounds
    assert _count(r"^\s*(@%p\d+\s+)?st\.global", ptx) == 3 * vpt * rounds
    assert _count(r"shfl\.sync\.bfly\.b32", ptx) == 3 * vpt * rounds  # offsets 1, 2, 4 per head
    assert _count(r"^\s*prefetch\.global\.L2 ", ptx) == (vpt + 2) * (rounds - 1)
    assert _count(r"griddepcontrol\.wait", ptx) == 1 and _count(r"griddepcontrol\.launch_dependents", ptx) == 1
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    if rounds > 1:  # the prefetches come before the first round's loads, after the wait
        assert ptx.index("griddepcontrol.wait") < ptx.index("prefetch.global.L2") < ptx.index("ld.global")
    assert ".shared" not in ptx and "bar.sync" not in ptx and "atom." not in ptx and ".local" not in ptx
    assert f".reqntid {EPI_BLOCK}, 1, 1" in ptx
    assert "rsqrt.approx.f32" in ptx and "cvt.f32.bf16" in ptx


@pytest.mark.parametrize("v", ALL, ids=lambda v: v.label)
def test_compile_sm90a(v):
    _check_ptx(_compile(v), v, "sm_90a")


def test_compile_sm100a():
    v = QkvEpilogueVariant(4)
    _check_ptx(_compile(v, "sm_100a"), v, "sm_100a")


def test_compile_is_deterministic():
    pytest.importorskip("cutlass")
    from musekern.builder.compile import compile_variant

    a, b = compile_variant(ALL[1], "sm_90a"), compile_variant(ALL[1], "sm_90a")
    assert a.cubin == b.cubin and a.ptx == b.ptx and a.symbol == b.symbol


def test_builds_are_distinct_kernels():
    assert len({_compile(v).cubin for v in ALL}) == len(ALL)


def _resources(ck, tmp_path) -> dict:
    """cuobjdump's resource usage of a build (skips without cuobjdump): no local memory, no stack."""
    usage = nvdump.resources(ck.cubin, tmp_path)
    if usage is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"local memory (spills or stack arrays): {usage}"
    return usage


@pytest.mark.parametrize("v", ALL, ids=lambda v: v.label)
def test_sass(v, tmp_path):
    ck = _compile(v)
    usage = _resources(ck, tmp_path)
    regs = (usage["REG"] + 7) // 8 * 8
    assert EPI_CTAS_PER_SM[(v.vecs_per_thread, v.rounds)] * EPI_BLOCK * regs <= 65536, f"{regs} registers"
    sass = nvdump.dump(ck.cubin, tmp_path, "-sass")
    if "Could not find executable" in sass.stderr:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    s = sass.stdout
    vpt, rounds = v.vecs_per_thread, v.rounds
    assert len(re.findall(r"\bLDG\.E\.128\b", s)) == (vpt + 2) * rounds
    assert len(re.findall(r"\bSTG\.E\.128\b", s)) == 3 * vpt * rounds
    assert len(re.findall(r"\bCCTL\.E\.PF2\b", s)) == (vpt + 2) * (rounds - 1)  # the L2 prefetches
    assert not re.search(r"\b(LDG|STG)\.E(\.(8|16|32|64))?\b(?!\.128)", s.replace("LDG.E.64", "")), \
        "a global access narrower than 16 bytes besides the position and slot loads"
    assert len(re.findall(r"\bLDG\.E\.64\b", s)) == 2 * rounds
    assert not re.search(r"\b(STL|LDL)\b", s), "local-memory spill in SASS"
    assert not re.search(r"\b(ATOMG|REDG|RED\.E)\b", s), "global atomic in SASS"
    assert not re.search(r"\bF2F\.BF16\.F32\b", s), "a bf16 rounding one value at a time (see _check_bf16_rounding)"
    # every y load is issued before the first shuffle waits on one (bytes in flight: bench/NOTES.md qkv_epilogue)
    head = s[:s.index("SHFL.BFLY")]
    assert len(re.findall(r"\bLDG\.E\.128\b", head)) >= vpt


def _check_bf16_rounding(sass: str, heads: int):
    """An FP8 build rounds a head's 8 results to bf16 by 4 packed conversions (kernel.py `_pack_bf16x2`), never one
    value at a time: F2F.BF16.F32 is a conversion-unit instruction, which ptxas chose for every value of every thread
    where the rounded k values are also read back as floats."""
    assert len(re.findall(r"\bF2FP\.BF16\.F32\.PACK_AB\b", sass)) == 4 * heads
    assert not re.search(r"\bF2F\.BF16\.F32\b", sass), "a bf16 rounding one value at a time"


# ---------------------------------------------------------------- FP8 KV cache builds (issue 29)
ALL_FP8 = list(all_builds("fp8_e4m3"))
SCALE_NAMES = ["k_scale_ptr", "k_scale", "v_scale_ptr", "v_scale"]


def fp8_units(v, m, n, nkv):
    """An FP8 build's unit mapping (kernel.py `_coords`), vectorized over the units every thread of the grid works on
    in its rounds: (live, row r, lane j, first head h0) a unit."""
    groups = row_units(v, n, nkv) // EPI_LANES
    live, wc = grid_units(v, m, n, nkv)
    t, j = wc // EPI_LANES, wc % EPI_LANES
    full = (m >> 2) * groups * 4  # 8-lane groups in whole blocks of four rows
    tail = t >= full  # the last M % 4 rows: one block of fewer rows
    rows = torch.where(tail, m & 3, 4)
    base = torch.where(tail, full, 0)
    u = t - base
    q = u // rows
    blk = q // groups
    g = q - blk * groups
    r = base // groups + blk * 4 + (u - q * rows)
    return live, r, j, g * v.vecs_per_thread


# Every FP8 build; TP8 (16 q heads, one k, one v: k and v share a group at vpt >= 2), TP4, TP1, the smallest layout;
# M from one row to whole blocks of four rows with and without a last block of 1-3 rows, grids that end mid-CTA.
# The GPU tests check the bytes; this checks the mapping alone: every (row, head, lane) once, every load in y, the
# 8 lanes of a group together, and a warp of whole blocks one head group (the k/v groups' e4m3 stores in warps of
# their own).
@pytest.mark.parametrize("v", ALL_FP8, ids=lambda v: v.label)
@pytest.mark.parametrize("m,n,nkv", [(1, 2176, 1), (7, 2176, 1), (1024, 2176, 1), (1027, 2176, 1), (33, 4352, 2),
                                     (6, 17408, 8), (5, 256, 1), (13, 1280, 2)])
def test_fp8_units_cover_every_head_once(v, m, n, nkv):
    live, r, j, h0 = fp8_units(v, m, n, nkv)
    nq, _ = head_counts(n, nkv)
    heads = nq + 2 * nkv
    assert bool(((r >= 0) & (r < m) & (h0 < heads)).all()), "a load outside y"  # a head past the last loads it
    cover = torch.zeros(m, heads, EPI_LANES, dtype=torch.int32)
    for u in range(v.vecs_per_thread):
        sel = live & (h0 + u < heads)
        cover.index_put_((r[sel], (h0 + u)[sel], j[sel]), torch.tensor(1, dtype=torch.int32), accumulate=True)
    assert bool((cover == 1).all()), "a (row, head, lane) not worked on exactly once"
    for x in (r, h0, live):  # the 8 lanes of a (row, head group): consecutive, all live or all dead
        assert bool((x.view(-1, EPI_LANES) == x.view(-1, EPI_LANES)[:, :1]).all())
    whole = (live & (r < m - m % 4)).view(-1, 32).all(1)
    warp_h0 = h0.view(-1, 32)
    assert bool((warp_h0[whole] == warp_h0[whole][:, :1]).all()), "a warp of whole blocks holds two head groups"


def test_fp8_abi_is_the_bf16_abi_then_the_scales():
    pytest.importorskip("cutlass")
    from musekern.kernels.qkv_epilogue.abi import abi_for

    for v in ALL_FP8:
        abi = abi_for(v)
        assert [p.name for p in abi.params] == PARAM_NAMES + SCALE_NAMES
        assert [(p.kind, p.align, p.size) for p in abi.params[-4:]] == [("pointer", 8, 8), ("scalar", 4, 4)] * 2
        assert abi.launch == abi_for(QkvEpilogueVariant(v.vecs_per_thread, v.rounds)).launch
        assert KernelAbi.from_json(abi.to_json()) == abi


# every FP8 build: the bf16 build's loads, shuffles and y stores; the cache stores 8-byte e4m3 vectors (a true fp32
# quotient by the scale, satfinite RN conversion), the scales read once (two predicated 4-byte loads) after the wait
@pytest.mark.parametrize("v", ALL_FP8, ids=lambda v: v.label)
def test_fp8_compile_sm90a(v):
    ck = _compile(v)
    assert cubin_arch(ck.cubin) == "sm_90a" and "kernel_fp8" in ck.symbol
    # bounded to the bf16 build's occupancy (variant.py): ptxas alone gave (2, 1) and (2, 2) a CTA an SM fewer
    assert f".maxntid {EPI_BLOCK}, 1, 1" in ck.ptx and f".minnctapersm {v.ctas_per_sm}" in ck.ptx
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    ptx = ck.ptx[ck.ptx.index(".entry " + ck.symbol):]
    vpt, rounds = v.vecs_per_thread, v.rounds
    assert _count(r"^\s*(@%p\d+\s+)?ld\.global(\.\w+)*\.v4\.(b32|u32|f32)\s", ptx) == (vpt + 2) * rounds
    assert _count(r"^\s*(@%p\d+\s+)?ld\.global", ptx) == (vpt + 4) * rounds
    assert _count(r"^\s*@p ld\.global\.f32", ptx) == 2  # the two scales: predicated on their pointer (fp8.py)
    assert _count(r"^\s*(@%p\d+\s+)?st\.global(\.\w+)*\.v4\.(b32|u32|f32)\s", ptx) == vpt * rounds  # y
    # key and value cache, each twice: a power-of-two scale's products, any other's quotients (fp8.py)
    assert _count(r"^\s*(@%p\d+\s+)?st\.global\.v2\.b32\s", ptx) == 4 * vpt * rounds
    assert _count(r"^\s*(@%p\d+\s+)?st\.global", ptx) == 5 * vpt * rounds
    assert _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == 16 * vpt * rounds
    assert _count(r"cvt\.rn\.bf16x2\.f32", ptx) == 4 * vpt * rounds  # k's bf16 rounding, packed as in y's
    # the division without the division (kernels/qkv_front/fp8.py): a reciprocal (rcp.rn's fast path) for the
    # k or v stores, then per value the clamp (NaN kept) and two FMAs, no div instruction
    assert 2 <= _count(r"rcp\.approx\.ftz\.f32", ptx) <= 2 * vpt * rounds  # (one a store site, some shared)
    assert not re.search(r"div\.(rn|approx|full)\.f32|rcp\.rn", ptx)
    assert _count(r"min\.NaN\.f32", ptx) == _count(r"copysign\.f32", ptx) == 16 * vpt * rounds
    assert _count(r"shfl\.sync\.bfly\.b32", ptx) == 3 * vpt * rounds
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.parametrize("v", ALL_FP8, ids=lambda v: v.label)
def test_fp8_sass(v, tmp_path):
    ck = _compile(v)
    usage = _resources(ck, tmp_path)
    regs = (usage["REG"] + 7) // 8 * 8  # the occupancy variant.py records (EPI_CTAS_PER_SM, as .minnctapersm)
    assert v.ctas_per_sm * EPI_BLOCK * regs <= 65536 < (v.ctas_per_sm + 1) * EPI_BLOCK * regs, f"{regs} registers"
    s = nvdump.dump(ck.cubin, tmp_path, "-sass").stdout
    vpt, rounds = v.vecs_per_thread, v.rounds
    assert len(re.findall(r"\bSTG\.E\.64\b", s)) == 4 * vpt * rounds
    assert len(re.findall(r"\bSTG\.E\.128\b", s)) == vpt * rounds
    assert len(re.findall(r"\bF2FP\.SATFINITE\.E4M3\.F32\.PACK_AB_MERGE_C\b", s)) == 16 * vpt * rounds
    assert not re.search(r"\b(STL|LDL)\b", s), "local-memory spill in SASS"
    _check_bf16_rounding(s, vpt * rounds)


def test_fp8_sm100a_compiles():
    ck = _compile(ALL_FP8[0], "sm_100a")
    assert cubin_arch(ck.cubin) == "sm_100a" and "cvt.rn.satfinite.e4m3x2.f32" in ck.ptx


def test_fp8_and_bf16_builds_are_distinct_kernels():
    assert len({_compile(v).cubin for v in ALL + ALL_FP8}) == len(ALL) + len(ALL_FP8)
