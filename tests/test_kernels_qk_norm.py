"""qk_norm CuTe DSL kernel: compile checks on CPU (no GPU), the launch grid, and the intended math.

The compile tests need nvidia-cutlass-dsl (the `build` extra); they are skipped without it.
"""
from __future__ import annotations

import itertools
import math
import re
import time

import pytest

from musekern.kernels.qk_norm.variant import (
    QK_NORM_BLOCK,
    QK_NORM_MAX_VECTORS,
    QK_NORM_TILE,
    QK_NORM_VEC_ELEMS,
    QK_NORM_VECS_PER_THREAD,
    QK_NORM_VPT_CHOICES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    QkNormVariant,
    launch_grid,
)
from musekern.store.abi import KernelAbi, check_abi_against_ptx, cubin_arch

# every dtype x head_dim x scale, in both work splits (4 vectors per thread for large inputs, 1 for small)
ALL_VARIANTS = [QkNormVariant(dt, hd, sc, vpt) for dt, hd, sc, vpt in
                itertools.product(SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, (False, True), QK_NORM_VPT_CHOICES)]
PARAM_NAMES = ["x", "out", "m", "heads", "ld_x", "ld_out", "eps", "scale"]


# ---------------------------------------------------------------- launch grid (pure)
def test_launch_constants_consistent():
    assert QK_NORM_TILE == QK_NORM_BLOCK * QK_NORM_VECS_PER_THREAD
    assert QK_NORM_VEC_ELEMS * 2 == 16  # 16-byte vectors of 2-byte elements
    for hd in SUPPORTED_HEAD_DIMS:
        lanes = hd // QK_NORM_VEC_ELEMS
        assert 32 % lanes == 0 and QK_NORM_BLOCK % lanes == 0  # groups never straddle a warp or a CTA


@pytest.mark.parametrize("hd,m,heads,want", [
    (64, 0, 64, (0, 1, 1)),
    (64, 1, 1, (1, 1, 1)),  # 8 vectors
    (64, 16, 64, (8, 1, 1)),  # 8192 vectors
    (64, 16, 8, (1, 1, 1)),  # 1024 vectors: exactly one tile
    (64, 17, 8, (2, 1, 1)),
    (128, 16, 32, (8, 1, 1)),
    (128, 4096, 32, (2048, 1, 1)),
    (256, 3, 5, (1, 1, 1)),  # 480 vectors
    (256, 4096, 16, (2048, 1, 1)),
    (64, 32768, 64, (16384, 1, 1)),
])
def test_launch_grid(hd, m, heads, want):
    """want: the 4-vector build's grid (1024 vectors a CTA); the 1-vector build walks 256 a CTA."""
    vectors = m * heads * hd // QK_NORM_VEC_ELEMS
    for dt, sc in itertools.product(SUPPORTED_DTYPES, (False, True)):
        assert launch_grid(QkNormVariant(dt, hd, sc), m, heads) == want
        assert launch_grid(QkNormVariant(dt, hd, sc, 1), m, heads) == (-(-vectors // QK_NORM_BLOCK), 1, 1)


def test_launch_grid_limits():
    v = QkNormVariant("bfloat16", 64, False)
    with pytest.raises(ValueError):
        launch_grid(v, -1, 8)
    heads = 64
    m_max = QK_NORM_MAX_VECTORS // (heads * 8)
    gx, _, _ = launch_grid(v, m_max, heads)
    assert gx * QK_NORM_TILE <= 2**31 - 1  # the kernel's Int32 vector index never overflows
    with pytest.raises(ValueError):
        launch_grid(v, m_max + 1, heads)


# ---------------------------------------------------------------- the intended math, on CPU
def _simulate(x_flat, m, heads, hd, ld_x, ld_out, eps, scale, out_len, dtype, vpt=QK_NORM_VECS_PER_THREAD):
    """Executes the kernel's work split thread by thread (vector indices, clamp, butterfly groups) on CPU.

    Returns (out_flat, read_offsets, write_counts) so tests can check coverage and bounds.
    """
    import torch

    lanes = hd // QK_NORM_VEC_ELEMS
    ncol = heads * lanes
    total = m * ncol
    v = QkNormVariant("bfloat16", hd, True, vpt)
    gx = launch_grid(v, m, heads)[0]
    out = torch.full((out_len,), float("nan"), dtype=dtype)
    writes = torch.zeros(out_len, dtype=torch.int32)
    reads_max = -1
    v_tile = v.tile
    for b in range(gx):
        for u in range(vpt):
            for warp0 in range(0, QK_NORM_BLOCK, 32):
                vals, live, offs_o = [], [], []
                for lane in range(32):
                    v = b * v_tile + u * QK_NORM_BLOCK + warp0 + lane
                    vc = min(v, total - 1)
                    r, c = divmod(vc, ncol)
                    off = r * ld_x + c * QK_NORM_VEC_ELEMS
                    assert off % QK_NORM_VEC_ELEMS == 0 and 0 <= off and off + 8 <= x_flat.numel()
                    reads_max = max(reads_max, off + 7)
                    vals.append(x_flat[off:off + 8].float())
                    live.append(v < total)
                    offs_o.append(r * ld_out + c * QK_NORM_VEC_ELEMS)
                ss = [float((f * f).sum()) for f in vals]  # per-lane sum of 8 squares (fp32)
                s = 1
                while s < lanes:  # butterfly: lane i adds lane i ^ s
                    ss = [torch.tensor(ss[i], dtype=torch.float32) + torch.tensor(ss[i ^ s], dtype=torch.float32)
                          for i in range(32)]
                    ss = [float(t) for t in ss]
                    s *= 2
                for lane in range(32):
                    # a group is all-live or all-dead
                    g0 = lane - lane % lanes
                    assert all(live[g0 + k] == live[lane] for k in range(lanes))
                    if not live[lane]:
                        continue
                    rs = torch.rsqrt(torch.tensor(ss[lane], dtype=torch.float32) * (1.0 / hd) + eps) * scale
                    o = offs_o[lane]
                    out[o:o + 8] = (vals[lane] * rs).to(dtype)
                    writes[o:o + 8] += 1
    return out, reads_max, writes


@pytest.mark.parametrize("vpt", QK_NORM_VPT_CHOICES)
@pytest.mark.parametrize("dtype_name", SUPPORTED_DTYPES)
@pytest.mark.parametrize("hd,m,heads,pad_x,pad_out", [
    (64, 3, 5, 8, 0), (128, 2, 3, 24, 16), (256, 5, 1, 0, 8), (64, 17, 8, 0, 0),
])
def test_intended_math_matches_reference(dtype_name, hd, m, heads, pad_x, pad_out, vpt):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(hd * 1000 + m * 10 + heads)
    n = heads * hd
    ld_x, ld_out = n + pad_x, n + pad_out
    x_flat = (torch.randn((m - 1) * ld_x + n, generator=g) * 3).to(dtype)  # last row unpadded: tight bounds
    out_len = (m - 1) * ld_out + n
    eps, scale = 1e-5, 0.125
    out, reads_max, writes = _simulate(x_flat, m, heads, hd, ld_x, ld_out, eps, scale, out_len, dtype, vpt)
    assert reads_max <= x_flat.numel() - 1
    x = torch.as_strided(x_flat, (m, n), (ld_x, 1))
    ref = (x.float().view(m, heads, hd) * torch.rsqrt(x.float().view(m, heads, hd).pow(2).mean(-1, keepdim=True)
                                                      + eps) * scale).to(dtype).view(m, n)
    got = torch.as_strided(out, (m, n), (ld_out, 1))
    wr = torch.as_strided(writes, (m, n), (ld_out, 1))
    assert bool((wr == 1).all()), "every output element is written exactly once"
    assert int(writes.sum()) == m * n, "nothing outside the output rows is written"
    # fp32 math, one rounding: equal to the reference up to one ulp of the output type
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=1e-6)


# ---------------------------------------------------------------- compile (needs the DSL)
_COMPILED: dict = {}
COMPILE_TIMES: dict = {}


def _compile_variant(variant, arch):
    # NB: dump files of --keep-cubin/--keep-ptx land where _dsl.compile_to_cubin sends them
    from musekern.builder.compile import compile_variant

    return compile_variant(variant, arch)


def _compile(variant, arch):
    pytest.importorskip("cutlass")
    key = (variant, arch)
    if key not in _COMPILED:
        t = time.perf_counter()
        _COMPILED[key] = _compile_variant(variant, arch)
        COMPILE_TIMES[key] = time.perf_counter() - t
    return _COMPILED[key]


def test_abi_for_is_pure_and_stable():
    from musekern.kernels.qk_norm.abi import abi_for

    for v in ALL_VARIANTS:
        abi = abi_for(v)
        assert [p.name for p in abi.params] == PARAM_NAMES
        assert [(p.kind, p.align, p.size) for p in abi.params] == (
            [("pointer", 8, 8)] * 2 + [("scalar", 4, 4)] * 6)
        assert [p.fields[0].type for p in abi.params] == ["u64", "u64", "i32", "i32", "i32", "i32", "f32", "f32"]
        assert abi.launch.block == (QK_NORM_BLOCK, 1, 1)
        assert abi.launch.cluster == (1, 1, 1) and abi.launch.dynamic_smem_bytes == 0 and not abi.launch.pdl
        assert abi.tensormaps == ()
        assert KernelAbi.from_json(abi.to_json()) == abi


_GLOBAL_LD = re.compile(r"^\s*(@%p\d+\s+)?ld\.global[.\w:]*\s", re.M)
_GLOBAL_LD_V4 = re.compile(r"^\s*(@%p\d+\s+)?ld\.global(\.nc)?(\.L1::[\w]+|\.L2::[\w]+)*\.v4\.(b32|u32|f32)\s", re.M)
_GLOBAL_ST = re.compile(r"^\s*(@%p\d+\s+)?st\.global[.\w:]*\s", re.M)
_GLOBAL_ST_V4 = re.compile(r"^\s*(@%p\d+\s+)?st\.global(\.L1::[\w]+|\.L2::[\w]+)*\.v4\.(b32|u32|f32)\s", re.M)


def _check_compiled(ck, variant, arch):
    assert ck.cubin[:4] == b"\x7fELF"
    assert cubin_arch(ck.cubin) == arch
    assert re.search(r"^\.target " + arch + r"\s*$", ck.ptx, re.M)
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    entry = ck.ptx[ck.ptx.index(".entry " + ck.symbol):]
    # every global access is one 16-byte vector; vecs_per_thread loads and stores per thread
    vpt = variant.vecs_per_thread
    assert len(_GLOBAL_LD_V4.findall(entry)) == vpt
    assert len(_GLOBAL_LD.findall(entry)) == vpt
    assert len(_GLOBAL_ST_V4.findall(entry)) == vpt
    assert len(_GLOBAL_ST.findall(entry)) == vpt
    # the group reduction: log2(head_dim/8) butterfly shuffles per vector, nothing through shared memory
    lanes = variant.head_dim // QK_NORM_VEC_ELEMS
    assert len(re.findall(r"shfl\.sync\.bfly\.b32", entry)) == vpt * int(math.log2(lanes))
    assert ".shared" not in entry and "bar.sync" not in entry and "atom." not in entry
    assert f".reqntid {QK_NORM_BLOCK}, 1, 1" in entry
    # has_scale=False compiles the multiply out: the scale parameter is declared but never read
    reads_scale = re.search(r"ld\.param\.\w+\s+%\w+, \[" + re.escape(ck.symbol) + r"_param_7\]", entry)
    assert bool(reads_scale) == variant.has_scale
    elem = "bf16" if variant.dtype == "bfloat16" else "f16"
    assert f"cvt.f32.{elem}" in entry and f"cvt.rn.{elem}x2.f32" in entry
    assert "rsqrt.approx.f32" in entry


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=lambda v: v.label)
def test_compile_sm90a(variant):
    ck = _compile(variant, "sm_90a")
    _check_compiled(ck, variant, "sm_90a")
    print(f"compile {variant.label} sm_90a: {COMPILE_TIMES[(variant, 'sm_90a')]:.2f} s")


@pytest.mark.parametrize("hd", SUPPORTED_HEAD_DIMS)
def test_compile_sm100a(hd):
    variant = QkNormVariant("bfloat16", hd, hd == 128)
    ck = _compile(variant, "sm_100a")
    _check_compiled(ck, variant, "sm_100a")
    print(f"compile {variant.label} sm_100a: {COMPILE_TIMES[(variant, 'sm_100a')]:.2f} s")


def test_compile_is_deterministic():
    v = QkNormVariant("float16", 128, True)
    pytest.importorskip("cutlass")
    a, b = _compile_variant(v, "sm_90a"), _compile_variant(v, "sm_90a")
    assert a.cubin == b.cubin and a.ptx == b.ptx and a.symbol == b.symbol


def test_variants_compile_to_distinct_kernels():
    cubins = {_compile(v, "sm_90a").cubin for v in ALL_VARIANTS}
    assert len(cubins) == len(ALL_VARIANTS)
