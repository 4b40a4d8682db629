"""qkv_front CuTe DSL kernel: CPU-only checks of every planned variant (no GPU).

- pure: launch geometry and shared-memory budget of every planned variant on every target;
- slow (compiles, ~0.5 s a variant on one core): the declared ABI equals the PTX `.entry`, the
  PTX has the instructions the design relies on (TMA ring, mma.sync bf16->f32, ldmatrix,
  st.async for S > 1, griddepcontrol.wait/launch_dependents, no global atomics, the exact
  expect_tx byte counts), and the SASS (cuobjdump, if installed) has HMMA.16816.F32.BF16,
  UTMALDG and no local-memory spill (STL/LDL).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from qkv_front_builds import front_builds, front_candidates, gpu_test_builds

from musekern.kernels.qkv_front.rules import CTAS_PER_SM, qkv_front_variants
from musekern.kernels.qkv_front.variant import (
    FRONT_MAX_TOKENS,
    HEAD_COLS,
    K_TILE,
    K_TILES,
    THREADS,
    W_STAGE_BYTES,
    QkvFrontVariant,
    launch_grid,
    padded_tokens,
    smem_bytes,
)
from musekern.targets import SM90_REGS_PER_SM, TARGETS, get_target


def planned_variants():
    from musekern.config import load_config
    from musekern.plan import plan_model

    return [e.variant for e in plan_model(load_config(), [get_target("h200")]) if e.kernel == "qkv_front"]


PLANNED = planned_variants()
# not planned for the H200, but legal: TP4's one-tile shape under "exit" with "rows", and the planned variants'
# other warp split at the S = 1 and S = 2 shapes (both tile counts).
EXTRA = [QkvFrontVariant(4352, 2, 1, 4, 2, 0, "exit")] \
    + [dataclasses.replace(v, warp_split="k" if v.warp_split == "rows" else "rows")
       for v in PLANNED if v.n in (2176, 8704) and not v.fixed_rows and v.warp_split != "wg"]
# above M = 16: the wgmma builds the rules give M = 17..64 at every shard, and the other code paths the bench times
# beside them (mma.sync "k" at 4 tiles; wgmma at 2 tiles; S = 4 without the receive buffer in the ring)
NEW = front_builds(get_target("h200"))
NEW_EXTRA = [v for name, v, _ in front_candidates(get_target("h200"))
             if name in ("tp8-m32-k", "tp2-m16-wg", "tp8-m64-s4")]
ARGS_FIELDS = {"weight", "x", "weight_ptr", "M", "y", "positions", "cos_sin_cache", "slot_mapping", "key_cache",
               "value_cache", "max_pos", "block_size", "num_blocks", "k_block_stride", "v_block_stride", "eps"}


# ---------------------------------------------------------------- pure (no cutlass)
def test_plan_has_every_shape():
    ns = sorted({v.n for v in PLANNED})
    assert ns == [2176, 4352, 8704, 17408]
    assert {(v.tiles, v.fixed_rows) for v in PLANNED} == {(1, 0), (1, 8), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0),
                                                         (8, 0)}


# every target x every build kind the planner makes (bf16 / e4m3 weights with each scale kind, bf16 / FP8 caches): the
# shared memory a W8A8 build's x slots take beside its ring is where a rule could overshoot
@pytest.mark.parametrize("kind", [("bf16", "bf16", "none"), ("fp8_e4m3", "bf16", "none"),
                                  ("bf16", "fp8_e4m3", "channel"), ("fp8_e4m3", "fp8_e4m3", "block")])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_smem_fits_every_target(target, kind):
    t = TARGETS[target]
    for n, nkv in ((2176, 1), (4352, 2), (8704, 4), (17408, 8)):
        for v in qkv_front_variants(n, nkv, t, FRONT_MAX_TOKENS, *kind):
            assert smem_bytes(v) <= t.max_smem_optin, v
            assert K_TILES % v.k_split == 0 and v.stages <= K_TILES // v.k_split
            assert padded_tokens(v) % v.k_split == 0  # every owner gets TT/S tokens (static expect_tx)


def test_launch_grid():
    v = QkvFrontVariant(2176, 1, 2, 8, 2, 0)
    assert launch_grid(v) == (68, 1, 1)
    assert launch_grid(QkvFrontVariant(17408, 8, 1, 8, 1, 8)) == (272, 1, 1)


def test_smem_bytes_formula():
    # ring (stages x (16 KiB W + TT x 256 B x)) + barriers (2 x stages + 1) + per owned token (TT / S) an 8 B slot
    # and a 256 B cos|sin row + the TT x 256 B receive buffer, padded to 1 KiB
    v = QkvFrontVariant(2176, 1, 2, 8, 2, 0)  # TT 16, 8 owned: 163840 + 208 + 2048 + 4096
    assert smem_bytes(v) == 171008
    assert smem_bytes(QkvFrontVariant(2176, 1, 1, 8, 2, 0)) == 151552  # TT 8, 4 owned: 147456 + 176 + 1024 + 2048
    # the 6-stage one-tile ring at S = 2 fits two CTAs per SM (H200: 228 KiB, 1 KiB reserved per CTA)
    assert 2 * (smem_bytes(QkvFrontVariant(2176, 1, 1, 6, 2, 0)) + 1024) <= 228 * 1024


def test_ops_import_does_not_import_cutlass():
    code = ("import sys, musekern.ops.qkv_front as q; assert hasattr(q, 'unsupported'); "
            "bad = [m for m in sys.modules if m == 'cutlass' or m.startswith('cutlass.')]; assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---------------------------------------------------------------- needs the DSL
@pytest.fixture(scope="module")
def kmod():
    """The kernel class, its ABI record and the builder's compile, under one name."""
    pytest.importorskip("cutlass")
    from types import SimpleNamespace

    from musekern.builder.compile import compile_variant
    from musekern.kernels.qkv_front.abi import abi_for
    from musekern.kernels.qkv_front.kernel import QkvFrontKernel

    return SimpleNamespace(QkvFrontKernel=QkvFrontKernel, abi_for=abi_for, compile_variant=compile_variant)


# every build the GPU tests and the bench launch above M = 16: the CuTe struct the kernel allocates is the size
# the loader reserves (compiling asserts it too; this checks the builds no slow test compiles)
@pytest.mark.parametrize("v", list(dict.fromkeys(NEW + gpu_test_builds(NEW) + [c[1] for c in front_candidates(
    get_target("h200"))])), ids=lambda v: v.label)
def test_smem_struct_is_smem_bytes(kmod, v):
    assert kmod.QkvFrontKernel(v).Smem.size_in_bytes() == smem_bytes(v)


@pytest.mark.parametrize("v", PLANNED + EXTRA + NEW + NEW_EXTRA, ids=lambda v: v.label)
def test_abi_declaration(kmod, v):
    abi = kmod.abi_for(v)
    names = {f.name for p in abi.params for f in p.fields}
    tm = {s.param: s for s in abi.tensormaps}
    # every field the op passes is declared (minus the tensor-map params, filled by the loader)
    assert names - set(tm) <= ARGS_FIELDS
    assert ("M" in names) == (v.fixed_rows == 0)
    pair = 2 if v.x_mcast else 1  # x_mcast: a cluster of both heads' CTAs, each loading half of the x rows
    assert abi.launch.block == (THREADS, 1, 1) and abi.launch.cluster == (v.k_split * pair, 1, 1) and abi.launch.pdl
    assert abi.launch.dynamic_smem_bytes == smem_bytes(v)
    assert tm["tma_w"].tensor == "weight" and tm["tma_w"].box == (64, HEAD_COLS) and tm["tma_w"].swizzle == "128B"
    assert tm["tma_x"].tensor == "x" and tm["tma_x"].box == (64, padded_tokens(v) // pair)
    assert tm["tma_x"].swizzle == "128B"
    assert tm["tma_x"].oob_fill == "none"  # rows >= M read as zeros


def test_unsupported_arch(kmod):
    with pytest.raises(NotImplementedError, match="sm_80"):
        kmod.compile_variant(PLANNED[0], "sm_80")


_COMPILED: dict = {}


def _compile(kmod, v, arch="sm_90a"):
    key = (v, arch)
    if key not in _COMPILED:
        t0 = time.perf_counter()
        ck = kmod.compile_variant(v, arch)
        _COMPILED[key] = (ck, time.perf_counter() - t0)
    return _COMPILED[key]


@pytest.fixture(autouse=True)
def _tmp_cwd(tmp_path, monkeypatch):
    # CuTe DSL's --keep-* may also drop files into the current directory
    monkeypatch.chdir(tmp_path)


def _count(pat, text):
    return len(re.findall(pat, text, re.M))


@pytest.mark.slow
@pytest.mark.parametrize("v", PLANNED + EXTRA + NEW + NEW_EXTRA, ids=lambda v: v.label)
def test_compile_ptx(kmod, v):
    from musekern.store.abi import check_abi_against_ptx

    ck, secs = _compile(kmod, v)
    assert secs < 120, f"compile took {secs:.1f}s"
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    ptx = ck.ptx
    tt = padded_tokens(v)
    assert ".target sm_90a" in ptx and f".reqntid {THREADS}, 1, 1" in ptx
    # TMA ring: prefill (stages x (2 W + 2 x boxes)) + the steady-state loop body (4 boxes); x_mcast: the x boxes
    # multicast (test_x_mcast_ptx_and_abi)
    pre = v.stages
    per_box = 1 if v.x_mcast else 2
    assert _count(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier::complete_tx", ptx) == \
        per_box * (2 * pre + (2 if pre < K_TILES // v.k_split else 0))
    # before the producer's griddepcontrol.wait (the first in the text): the W boxes of the prefill only
    assert _count(r"cp\.async\.bulk\.tensor", ptx.split("griddepcontrol.wait")[0]) == 2 * pre
    stage_tx = W_STAGE_BYTES + tt * K_TILE * 2
    assert re.search(rf"mov\.b32\s+%r\d+, {stage_tx};\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    n_mma = _count(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)
    n_x4 = _count(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", ptx)
    n_x2 = _count(r"ldmatrix\.sync\.aligned\.m8n8\.x2\.shared\.b16", ptx)
    n_wg = _count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tt}k16\.f32\.bf16\.bf16", ptx)
    if v.warp_split == "wg":
        # one warpgroup: a k-tile is 8 wgmma m64nTTk16 straight from the ring (descriptors: no ldmatrix, no mma.sync),
        # one commit group, waited on before the stage is released
        assert (n_wg, n_mma, n_x4, n_x2) == (8, 0, 0, 0)
        assert _count(r"wgmma\.commit_group\.sync\.aligned", ptx) == 1
        assert _count(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx) == 1
        per_thread_sends = tt * HEAD_COLS // 128  # one st.async per accumulator element
        # the owner epilogue (qkv_front_epi.py) with 16 owned tokens or more: per group of four tokens a warp, 16-byte
        # loads of the S partials (two a token) and of cos | sin, three shuffle rounds, 16-byte stores of y, k and v;
        # else a lane per RoPE pair: five shuffle rounds a token, no 16-byte access
        owned = tt // v.k_split
        rounds = -(-owned // 16)
        octets = owned >= 16
        assert _count(r"ld\.shared\.v4\.b32", ptx) == (rounds * (2 * v.k_split + 2) if octets else 0)
        assert _count(r"st\.global\.v4\.b32", ptx) == (3 * rounds if octets else 0)
        assert _count(r"shfl\.sync\.bfly\.b32", ptx) == (3 * rounds if octets else 5 * (owned // 4))
        # the ring is idle before the partials land in it: a cluster barrier, or (S == 1) the consumer warps' one
        assert _count(r"bar\.sync\s+3, 128", ptx) == (1 if v.recv_in_ring and v.k_split == 1 else 0)
        # with S > 1 a CTA's own tokens' partials are plain stores, ordered by the consumer warps' barrier 1: one 4-byte
        # shared store per accumulator element (the other ranks' go by st.async: checked below), beside the aux warp's
        # two per owned token (its cos | sin columns)
        assert _count(r"bar\.sync\s+1, 128", ptx) == 1
        assert _count(r"st\.shared\.b32", ptx) == per_thread_sends + 2 * owned
    elif v.warp_split == "rows":
        # per k-tile a warp: 8 k-steps x (TT / 8) n8 atoms, ldmatrix x4 for W, for x x4 per 16 tokens (x2 at TT=8)
        assert n_mma == 8 * (tt // 8)
        assert (n_x4, n_x2) == ((8 * (1 + tt // 16), 0) if tt >= 16 else (8, 8))
        per_thread_sends = 4 * (tt // 8)  # one st.async per accumulator element
    elif v.tiles > 2:
        # "k" with 4 tiles, one register set: one load block of 2 x (4 W x4 + TT / 16 x x4), one MMA block
        assert n_mma == 2 * 4 * (tt // 8)
        assert (n_x4, n_x2) == (2 * (4 + tt // 16), 0)
        per_thread_sends = tt * HEAD_COLS // 128
        assert _count(r"bar\.sync\s+3, 128", ptx) == 2
    else:
        # per k-tile a warp: 2 k-steps x 4 m16 x (TT / 8) n8; the loop is unrolled by two (two register
        # sets) after a one-tile prologue: 3 load blocks of 2 x (4 W x4 + 1 x ldmatrix), 2 MMA blocks
        assert n_mma == 2 * 2 * 4 * (tt // 8)
        assert (n_x4, n_x2) == (3 * 2 * (4 + (1 if tt == 16 else 0)), 3 * 2 if tt == 8 else 0)
        per_thread_sends = tt * HEAD_COLS // 128  # the 4-warp sums, spread over the 128 consumer threads
        assert _count(r"bar\.sync\s+3, 128", ptx) == 2  # ring idle / partials written
    # cluster exchange: complete_tx on the owner's barrier
    n_st = _count(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.b32", ptx)
    if v.k_split > 1:
        assert n_st == per_thread_sends
        # what st.async brings an owner: the S partials of its TT / S tokens, less its own (plain stores) in "wg"
        recv_tx = (v.k_split - (v.warp_split == "wg")) * (tt // v.k_split) * HEAD_COLS * 4
        assert re.search(rf"mov\.b32\s+%r\d+, {recv_tx};\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
        # after init, before exit, and (recv_in_ring) once per role (producer, aux, consumers) before the sends
        assert _count(r"barrier\.cluster\.wait", ptx) == 2 + 3 * v.recv_in_ring
    elif not v.x_mcast:
        assert n_st == 0 and "barrier.cluster" not in ptx  # S == 1: partials stay in the CTA
    # PDL: producer (before x), aux (before positions/slots/cos|sin), consumers (before stores)
    assert _count(r"griddepcontrol\.wait", ptx) == 3
    assert _count(r"griddepcontrol\.launch_dependents", ptx) == (0 if v.trigger == "exit" else 1)
    # no global atomics, no scratch
    assert _count(r"^\s*(@%p\d+\s+)?(atom|red)\.", ptx) == 0
    assert ".local" not in ptx


# x multicast between the heads of a pair: the S = 4 8-tile TP8 build (a cluster of 8) and the S = 1 4-tile TP2 one
# (a cluster of 2, partials in the CTA)
XMC = [QkvFrontVariant(n=2176, num_kv_heads=1, tiles=8, stages=3, k_split=4, fixed_rows=0, trigger="exit",
                       warp_split="wg", recv_in_ring=True, x_mcast=True),
       QkvFrontVariant(n=8704, num_kv_heads=4, tiles=4, stages=4, k_split=1, fixed_rows=0, trigger="exit",
                       warp_split="wg",
                       x_mcast=True)]


@pytest.mark.slow
@pytest.mark.parametrize("v", XMC, ids=lambda v: v.label)
def test_x_mcast_ptx_and_abi(kmod, v):
    ck, _ = _compile(kmod, v)
    ptx = ck.ptx
    tt = padded_tokens(v)
    # the launch: a cluster of both heads' S CTAs, x boxes of half the rows (each CTA of a pair loads one half)
    assert ck.abi.launch.cluster == (2 * v.k_split, 1, 1)
    assert [t.box for t in ck.abi.tensormaps] == [(64, HEAD_COLS), (64, tt // 2)]
    # W per CTA as before; x multicast to both heads of the pair, mask = bits rank and rank + S
    boxes = 2 * v.stages + (2 if v.stages < K_TILES // v.k_split else 0)
    assert _count(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx) == boxes
    assert _count(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global.*multicast::cluster", ptx) == boxes
    assert re.search(rf"mov\.b16\s+%rs\d+, {1 | 1 << v.k_split};", ptx)
    # a stage's empty barrier counts both heads' consumer warps; each warp arrives locally and on the peer's
    eight = re.search(r"mov\.b32\s+(%r\d+), 8;\s*\n\s*mbarrier\.init", ptx)[1]
    assert _count(rf"mbarrier\.init\.shared(::cta)?\.b64\s+\[[^]]+\], {eight};", ptx) == v.stages
    assert _count(r"mbarrier\.arrive\.shared::cluster", ptx) == 1
    # whole-tile bytes land in each CTA per stage (its half and the peer's)
    stage_tx = W_STAGE_BYTES + tt * K_TILE * 2
    assert re.search(rf"mov\.b32\s+%r\d+, {stage_tx};\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    assert "barrier.cluster" in ptx


def _nv_bin(name):
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    for d in dirs:
        hits = glob.glob(os.path.join(d, "nvidia", "*", "bin", name)) + glob.glob(os.path.join(d, "nvidia", "*",
                                                                                              "*", "bin", name))
        if hits:
            return hits[0]
    return shutil.which(name)


@pytest.mark.slow
@pytest.mark.parametrize("v", PLANNED + NEW + NEW_EXTRA, ids=lambda v: v.label)
def test_sass(kmod, v, tmp_path):
    cuobjdump = _nv_bin("cuobjdump")
    if not cuobjdump:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    ck, _ = _compile(kmod, v)
    cub = tmp_path / "k.cubin"
    cub.write_bytes(ck.cubin)
    env = dict(os.environ)
    nvdisasm = _nv_bin("nvdisasm")
    if nvdisasm:
        env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    res = subprocess.run([cuobjdump, "--dump-resource-usage", str(cub)], capture_output=True, text=True, env=env)
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", res.stdout, re.S)
    assert m, res.stdout + res.stderr
    assert int(m.group(2)) == 0, "local memory (spills or stack arrays)"
    if v.stages < 8:  # the shallow ring is planned for two CTAs per SM: the register file must hold them too
        regs = (int(m.group(1)) + 7) // 8 * 8  # allocated per warp in units of 8 per thread
        assert CTAS_PER_SM * THREADS * regs <= SM90_REGS_PER_SM, f"{regs} registers: one CTA per SM"
    sass = subprocess.run([cuobjdump, "-sass", str(cub)], capture_output=True, text=True, env=env)
    if "Could not find executable" in sass.stderr:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    s = sass.stdout
    if v.warp_split == "wg":
        assert f"HGMMA.64x{padded_tokens(v)}x16.F32.BF16" in s and "HMMA" not in s and "LDSM" not in s
    else:
        assert "HMMA.16816.F32.BF16" in s and "LDSM" in s
    assert "UTMALDG" in s
    assert not re.search(r"\b(STL|LDL)\b", s), "local-memory spill in SASS"
    assert not re.search(r"\b(ATOMG|REDG|RED\.E)\b", s), "global atomic in SASS"
    if v.k_split > 1:
        assert "STAS" in s  # st.async


@pytest.mark.slow
def test_sm100a_compiles(kmod):
    ck, _ = _compile(kmod, PLANNED[0], "sm_100a")
    assert ".target sm_100a" in ck.ptx
    assert _count(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ck.ptx) > 0


# wgmma exists on sm_90a only: a "wg" build for sm_100a is refused before any compile, and the B200's plan never
# asks for one (mma.sync up to 4 tiles there; above 32 tokens cuBLAS + the fused epilogue)
def test_wgmma_builds_are_sm90a_only(kmod):
    wg = next(v for v in NEW if v.warp_split == "wg")
    with pytest.raises(NotImplementedError, match="wgmma"):
        kmod.compile_variant(wg, "sm_100a")
    b200 = get_target("b200")
    for n, nkv in ((2176, 1), (4352, 2), (8704, 4), (17408, 8)):
        assert all(v.warp_split != "wg" for v in qkv_front_variants(n, nkv, b200, FRONT_MAX_TOKENS))


@pytest.mark.slow
def test_compile_is_deterministic(kmod):
    v = PLANNED[0]
    a = kmod.compile_variant(v, "sm_90a")
    b = kmod.compile_variant(v, "sm_90a")
    assert a.cubin == b.cubin and a.symbol == b.symbol


# ---------------------------------------------------------------- FP8 KV cache builds (issue 29)
FP8 = "fp8_e4m3"
PLANNED_FP8 = [dataclasses.replace(v, kv_cache_dtype=FP8) for v in PLANNED]  # the fp8 plan (test_config checks it)
SCALE_PARAMS = [("k_scale_ptr", "pointer", 8), ("k_scale", "scalar", 4), ("v_scale_ptr", "pointer", 8),
                ("v_scale", "scalar", 4)]


@pytest.mark.parametrize("v", PLANNED_FP8, ids=lambda v: v.label)
def test_fp8_abi_is_the_bf16_abi_then_the_scales(kmod, v):
    bf16 = kmod.abi_for(dataclasses.replace(v, kv_cache_dtype="bf16"))
    abi = kmod.abi_for(v)
    shape = lambda params: [(p.name, p.kind, p.align, p.size, p.fields) for p in params]  # noqa: E731
    assert shape(abi.params[:-4]) == shape(bf16.params)
    assert [(p.name, p.kind, p.size) for p in abi.params[-4:]] == SCALE_PARAMS
    assert (abi.launch, abi.tensormaps) == (bf16.launch, bf16.tensormaps)


def _ops(ptx: str) -> dict:
    """Counts of the instructions an FP8 build must share with its bf16 build (the GEMM, the ring, the exchange)."""
    pats = {"mma": r"mma\.sync\.aligned", "wgmma": r"wgmma\.mma_async", "tma": r"cp\.async\.bulk\.tensor",
            "ldmatrix": r"ldmatrix\.sync", "st.async": r"st\.async", "wait": r"griddepcontrol\.wait",
            "trigger": r"griddepcontrol\.launch_dependents", "cluster": r"barrier\.cluster\.wait",
            "shfl": r"shfl\.sync"}
    return {k: _count(p, ptx) for k, p in pats.items()}


# The FP8 stores' quotient (kernels/qkv_front/fp8.py: a reciprocal, a clamp and two FMAs instead of a division), in C
# with the same fp32 operations: its e4m3 byte is x / scale's for all 65536 bf16 x at 1500 scales (every fp32 exponent
# -149..127 with four mantissas, then random ones; 40000 in the probe's own run). No GPU: the hardware's run is
# tests/test_gpu_kv_cache.py's every-bf16-value test.
def test_fp8_quotient_is_the_true_division(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    src = os.path.join(os.path.dirname(__file__), "..", "bench", "probes", "fp8_division.c")
    exe = str(tmp_path / "fp8_division")
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-o", exe, src, "-lm"], check=True, capture_output=True)
    r = subprocess.run([exe, "1500"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("mismatches 0"), r.stdout[-2000:]
    assert int(re.search(r"bit-compared (\d+)", r.stdout).group(1)) > 5_000_000


# every FP8 build of the h200 plan (both owner epilogues: a lane a RoPE pair, eight lanes a token): the ABI is the
# PTX .entry's, the cache stores are e4m3 satfinite conversions of the correctly rounded fp32 quotient (fp8.py: one
# reciprocal, two FMAs a value) at half the bf16 width, and everything else (MMA, TMA ring, cluster exchange, PDL) is
# the bf16 build's instruction for instruction
@pytest.mark.slow
@pytest.mark.parametrize("v", PLANNED_FP8, ids=lambda v: v.label)
def test_fp8_compile_ptx(kmod, v):
    from musekern.kernels.qkv_front.octets import OCTET_MIN_OWNED
    from musekern.store.abi import check_abi_against_ptx, ptx_entry_params

    ck, _ = _compile(kmod, v)
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    assert "kernel_fp8" in ck.symbol and len(ptx_entry_params(ck.ptx, ck.symbol)) == len(ck.abi.params)
    bf, _ = _compile(kmod, dataclasses.replace(v, kv_cache_dtype="bf16"))
    ptx = ck.ptx
    assert _ops(ptx) == _ops(bf.ptx)
    owned = padded_tokens(v) // v.k_split
    octets = v.warp_split == "wg" and owned >= OCTET_MIN_OWNED
    rounds = -(-owned // 16) if octets else owned // 4  # a warp's groups of four tokens, or its tokens
    per_store = 8 if octets else 2  # values a lane stores: its 16-byte vector, or its RoPE pair
    # each store twice: a power-of-two scale's products, any other's quotients (fp8.py)
    assert _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == rounds * per_store
    assert _count(r"min\.NaN\.f32", ptx) == _count(r"copysign\.f32", ptx) == rounds * per_store
    assert _count(r"rcp\.approx\.ftz\.f32", ptx) == 1 and not re.search(r"div\.(rn|approx|full)\.f32|rcp\.rn", ptx)
    if octets:  # y: 16 bytes a lane; the cache: 8
        assert _count(r"st\.global\.v4\.b32", ptx) == rounds and _count(r"st\.global\.v2\.b32", ptx) == 2 * rounds
    else:  # y: the pair's 4 bytes (two bf16 stores the compiler may merge); the cache: 2 bytes
        assert _count(r"st\.global\.b16", ptx) == 2 * rounds
    assert _count(r"st\.global\.v4\.b32", bf.ptx) == (3 * rounds if octets else 0)


def _no_local_memory(cubin: bytes, tmp_path) -> dict:
    """The cubin's resource usage (cuobjdump; the test skips where it is not installed), asserted free of local memory
    and stack."""
    import nvdump

    usage = nvdump.resources(cubin, tmp_path)
    if usage is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"local memory: {usage}"
    return usage


@pytest.mark.slow
@pytest.mark.parametrize("v", [v for v in PLANNED_FP8 if v.tiles in (1, 8)], ids=lambda v: v.label)
def test_fp8_sass(kmod, v, tmp_path):
    import nvdump

    ck, _ = _compile(kmod, v)
    usage = _no_local_memory(ck.cubin, tmp_path)
    if v.stages < 8:  # two CTAs per SM, as the bf16 build
        assert CTAS_PER_SM * THREADS * ((usage["REG"] + 7) // 8 * 8) <= SM90_REGS_PER_SM
    s = nvdump.dump(ck.cubin, tmp_path, "-sass").stdout
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C" in s
    assert re.search(r"\bSTG\.E\.(64|U16)\b", s), "the e4m3 cache store"
    assert not re.search(r"\b(STL|LDL)\b", s)


@pytest.mark.slow
def test_fp8_sm100a_compiles(kmod):
    v = next(v for v in PLANNED_FP8 if v.warp_split != "wg")
    ck, _ = _compile(kmod, v, "sm_100a")
    assert ".target sm_100a" in ck.ptx and "cvt.rn.satfinite.e4m3x2.f32" in ck.ptx


# ---------------------------------------------------------------- e4m3 weights (issue 30, kernels/qkv_front/w8.py)
def _w8_plan():
    """Every e4m3-weight build the h200 rules give M = 1..64 on the bundled model's shards (M <= 16 everywhere, the
    4-tile build to 32 at TP8), both scale kinds, and one with an FP8 KV cache too (the two fields are independent)."""
    from musekern.config import load_config

    model = load_config()
    out = []
    for tp in (8, 4, 2, 1):
        s = model.shard(tp)
        for scale in ("channel", "block"):
            out += qkv_front_variants(s.n, s.num_kv_heads, get_target("h200"), 64, "bf16", "fp8_e4m3", scale)
    return out + [dataclasses.replace(out[0], kv_cache_dtype=FP8)]


PLANNED_W8 = _w8_plan()
PLANNED_W8A8 = [v for v in PLANNED_W8 if v.warp_split == "wg"]  # W8A8: TP8's one- and two-tile builds, x ahead
# W8A8 with x quantized in the kernel (x_dtype bf16): TP8's one-tile build, channel and block, kept buildable
W8A8_IN_KERNEL = [dataclasses.replace(v, x_dtype="bf16") for v in PLANNED_W8A8 if v.tiles == 1
                  and v.kv_cache_dtype == "bf16"]


# the grid: every planned e4m3 build (mma.sync "rows" and "k", 1, 2 and 4 tiles, S = 1 and 2, both scale kinds)
@pytest.mark.parametrize("v", PLANNED_W8, ids=lambda v: v.label)
def test_w8_abi_is_the_bf16_abi_with_the_scales_in_the_weight_slot(kmod, v):
    bf = kmod.abi_for(dataclasses.replace(v, weight_dtype="bf16", weight_scale="none", warp_split="k",
                                          x_dtype="bf16"))
    abi = kmod.abi_for(v)
    # x quantized ahead: x's scales follow the weight's, x's map is of e4m3 bytes (one 128-byte box a k-tile)
    ahead = v.x_dtype != "bf16"
    names = [("weight_scale" if p.name == "weight_ptr" else p.name) for p in bf.params]
    if ahead:
        names.insert(names.index("weight_scale") + 1, "x_scale")
    assert [p.name for p in abi.params] == names
    assert [(p.kind, p.size) for p in abi.params if p.name != "x_scale"] == [(p.kind, p.size) for p in bf.params]
    w, wb = abi.tensormaps[0], bf.tensormaps[0]
    assert (w.param, w.tensor, w.dtype, w.box) == ("tma_w", "weight", "u8", (128, HEAD_COLS)) and wb.dtype == "bf16"
    x, xb = abi.tensormaps[1], bf.tensormaps[1]
    assert (x.dtype, x.box) == (("u8", (128, xb.box[1])) if ahead else (xb.dtype, xb.box))
    assert abi.launch.dynamic_smem_bytes == smem_bytes(v)


def test_w8_variant_rules():
    h200 = get_target("h200")
    with pytest.raises(ValueError, match="weight_scale of a fp8_e4m3 weight"):
        QkvFrontVariant(2176, 1, 1, 4, 2, 0, weight_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="weight_scale of a bf16 weight"):
        QkvFrontVariant(2176, 1, 1, 4, 2, 0, weight_scale="block")
    with pytest.raises(ValueError, match="wgmma build \\(W8A8\\) with bf16 x holds at most 1 token tiles"):
        QkvFrontVariant(2176, 1, 2, 4, 2, 0, warp_split="wg", weight_dtype="fp8_e4m3", weight_scale="channel")
    # x quantized ahead: half the bytes in x's slots, two tiles; an e4m3 weight's wgmma build's alone
    QkvFrontVariant(2176, 1, 2, 10, 2, 0, warp_split="wg", weight_dtype="fp8_e4m3", weight_scale="channel",
                    x_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="with fp8_e4m3 x holds at most 2 token tiles"):
        QkvFrontVariant(2176, 1, 4, 4, 2, 0, warp_split="wg", weight_dtype="fp8_e4m3", weight_scale="channel",
                        x_dtype="fp8_e4m3")
    for bad in (dict(weight_dtype="fp8_e4m3", weight_scale="channel"), dict(warp_split="wg")):
        with pytest.raises(ValueError, match="x_dtype fp8_e4m3 \\(x quantized ahead\\) is an e4m3 weight's wgmma"):
            QkvFrontVariant(2176, 1, 1, 4, 2, 0, x_dtype="fp8_e4m3", **bad)
    with pytest.raises(ValueError, match="x_dtype must be one of"):
        QkvFrontVariant(2176, 1, 1, 4, 2, 0, x_dtype="e5m2")
    from musekern.kernels.qkv_front.rules import front_serves, variant

    # M <= 16 on every shard; up to 32 (4 tiles) where those CTAs are alone on their SMs: TP8 (68 CTAs), not TP4 (136)
    assert front_serves(2176, 32, h200, "fp8_e4m3") and not front_serves(2176, 33, h200, "fp8_e4m3")
    assert front_serves(4352, 16, h200, "fp8_e4m3") and not front_serves(4352, 17, h200, "fp8_e4m3")
    with pytest.raises(ValueError, match="no fp8_e4m3 front build serves N = 2176, M = 33"):
        variant(2176, 33, 1, h200, weight_dtype="fp8_e4m3", weight_scale="block")
    assert {variant(2176, m, 1, h200, weight_dtype="fp8_e4m3", weight_scale="block").label for m in (17, 25, 32)} == {
        "qkv_front[fixed_rows=0,k_split=2,n=2176,num_kv_heads=1,stages=6,tiles=4,trigger=late,trigger_ahead=6,"
        "warp_split=k,weight_dtype=fp8_e4m3,weight_scale=block]"}  # the build bench/probes/w8_wide.py checked and timed
    # up to the same W bytes in flight: up to twice the stages of half the size, as shared memory allows; the bf16
    # build's split and trigger; warp split "k" ("rows", the bf16 builds' one tile under the late trigger, measured
    # slower for e4m3: bench/probes/w8_alts.py k1, k1tp2), except W8A8's "wg" at one runtime-M tile: x quantized in the
    # kernel where the CTAs are alone on their SMs (TP8, the ring of its W8A16 twin), x quantized ahead on the
    # deep-ring shard (TP1, the deepest ring its x slots leave) (bench/NOTES.md "e4m3 weights")
    for v in PLANNED_W8:
        bf = variant(v.n, max(1, 8 * v.tiles - 1), v.num_kv_heads, h200)
        assert (v.k_split, v.tiles, v.trigger) == (bf.k_split, bf.tiles, bf.trigger)
        in_kernel = v.n == 2176 and v.tiles == 1 and not v.fixed_rows
        ahead = v.n == 17408 and v.tiles == 1
        assert (v.warp_split, v.x_dtype) == (("wg", "fp8_e4m3") if ahead else ("wg" if in_kernel else "k", "bf16"))
        if in_kernel:
            assert v.stages == dataclasses.replace(v, warp_split="k").stages and smem_bytes(v) <= h200.max_smem_optin
        elif ahead:
            assert not v.fixed_rows and smem_bytes(v) <= h200.max_smem_optin
            assert smem_bytes(dataclasses.replace(v, stages=v.stages + 1)) > h200.max_smem_optin
        else:
            assert bf.stages < v.stages <= 2 * bf.stages
    assert {v.warp_split for v in PLANNED_W8 if v.n == 2176 and v.tiles == 1} == {"wg", "k"}  # M <= 7 / M == 8
    assert {(v.tiles, v.x_dtype) for v in PLANNED_W8 if v.n == 17408} == {(1, "fp8_e4m3"), (2, "bf16")}  # 1-8, 9-16
    b200 = get_target("b200")  # no wgmma: W8A16 everywhere
    assert variant(2176, 1, 1, b200, weight_dtype="fp8_e4m3", weight_scale="block").warp_split == "k"


# each W8A16 build: the ABI is the PTX .entry's; W arrives as one 128-byte-wide box a stage (8 KiB + x in expect_tx);
# every weight of a stage is loaded once per CTA by ldmatrix.x4 (an m16 block's two k16 steps: 4 a warp a k-tile, 1 m16
# x 4 pairs with "rows", 4 m16 x 1 pair with "k") and converted by w8.bf16x2_half (cvt.rn.f16x2.e4m3x2, 8 an
# ldmatrix); x by 8-byte loads (one a k16 step and token tile), no x ldmatrix; the MMAs are the bf16 build's, over two
# register sets where the bf16 build writes one; block scales: staged in shared memory once, no global load in the
# k-tile loop
@pytest.mark.slow
@pytest.mark.parametrize("v", [v for v in PLANNED_W8 if v.warp_split != "wg"], ids=lambda v: v.label)
def test_w8_compile_ptx(kmod, v):
    from musekern.store.abi import check_abi_against_ptx

    ck, _ = _compile(kmod, v)
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    ptx = ck.ptx
    bf, _ = _compile(kmod, dataclasses.replace(v, weight_dtype="bf16", weight_scale="none",
                                               stages=min(v.stages, 4)))
    tt = padded_tokens(v)
    stage_tx = W_STAGE_BYTES // 2 + tt * K_TILE * 2
    assert re.search(rf"mov\.b32\s+%r\d+, {stage_tx};\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    mma = r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"
    sets = 2 if v.warp_split == "rows" or v.tiles > 2 else 1
    assert _count(mma, ptx) == _count(mma, bf.ptx) * sets
    copies = 3  # a k-tile's loads are written out three times: before the loop and once for each register set
    a_ldm = _count(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", ptx)
    assert a_ldm == copies * 4 and _count(r"ldmatrix\.sync\.aligned\.m8n8\.x2", ptx) == 0
    assert _count(r"cvt\.rn\.f16x2\.e4m3x2", ptx) == 8 * a_ldm
    steps = 8 if v.warp_split == "rows" else 2  # k16 steps a warp reads of a k-tile
    x64 = r"ld\.shared\.[bu]64"
    assert _count(x64, ptx) - _count(x64, bf.ptx) == copies * steps * tt // 8
    assert _count(r"ld\.shared\.[bsu]16", ptx) == 0


# each W8A8 build (the planned ones, x quantized ahead; the in-kernel one-tile build): the ABI is the PTX .entry's; a
# ring stage is W only (8 KiB in expect_tx) and x lands a chunk of X8_CHUNK k-tiles a barrier (bf16 or e4m3 bytes);
# the MMA is wgmma m64nTTk32 e4m3 x e4m3 (4 a k-tile, nothing converts W: no mma.sync, no ldmatrix, no e4m3 -> f16);
# in the kernel x is quantized by cvt.rn.satfinite.e4m3x2.f32 after abs.bf16x2 maxima, its stores made visible to
# wgmma by fence.proxy.async; ahead: no conversion at all
@pytest.mark.slow
@pytest.mark.parametrize("v", PLANNED_W8A8 + W8A8_IN_KERNEL, ids=lambda v: v.label)
def test_w8a8_compile_ptx(kmod, v):
    from musekern.kernels.qkv_front.mma import WG8_RUN
    from musekern.kernels.qkv_front.variant import X8_CHUNK
    from musekern.store.abi import check_abi_against_ptx

    ck, _ = _compile(kmod, v)
    check_abi_against_ptx(ck.abi, ck.ptx, ck.symbol)
    ptx = ck.ptx
    tt = padded_tokens(v)
    ahead = v.x_dtype != "bf16"
    for tx in (W_STAGE_BYTES // 2, X8_CHUNK * tt * K_TILE * (1 if ahead else 2)):
        assert re.search(rf"mov\.b32\s+%r\d+, {tx};\s*\n\s*mbarrier\.arrive\.expect_tx", ptx), tx
    # a run of WG8_RUN k-tiles unrolled (mma.py), 4 k32 steps a k-tile
    run = min(WG8_RUN, K_TILES // v.k_split)
    assert _count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tt}k32\.f32\.e4m3\.e4m3", ptx) == run * K_TILE // 32
    assert _count(r"mma\.sync", ptx) == _count(r"ldmatrix", ptx) == _count(r"cvt\.rn\.f16x2\.e4m3x2", ptx) == 0
    quantizes = _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) > 0 and _count(r"abs\.bf16x2", ptx) > 0
    assert quantizes != ahead
    fences = _count(r"fence\.proxy\.async\.shared::cta", ptx)
    assert fences == 0 if ahead else fences >= 2  # the consumers' chunk, the aux warp's


# W8A8: the in-place quantization's byte mapping (w8.x8_src / x8_dst, mma.py `_quantize_chunk`) over one CTA's x
# slots (TP8: 32 k-tiles, tt = 8), callers as the kernel has them: the consumer warps' chunk 0 (warp w: tokens w, w + 4)
# and the aux warp's chunks 1.. (tokens 0-3, then 4-7). Every unit (token < M, k-tile, quarter q = lane % 4) once; it
# reads its 32 columns where the TMA put them (the x stage layout above); each e4m3 byte lands once, at its column's
# place in an e4m3 tile's 128B swizzle (what wgmma's B descriptor reads); a (token, k-tile)'s writes stay inside its
# own reads (its 4 lanes, one warp, ordered by the sync_warp before the writes), and no two groups' bytes meet. The
# grid: M = 1 (decode), 3 and 5 (a caller's tokens partly past M), 7 (the build's largest).
@pytest.mark.parametrize("m", [1, 3, 5, 7])
def test_w8a8_quantize_mapping(m):
    pytest.importorskip("cutlass")
    from musekern.kernels.qkv_front import w8
    from musekern.kernels.qkv_front.variant import CONSUMER_WARPS, X8_CHUNK

    tt, ntiles = 8, 32
    calls = [(0, [w + CONSUMER_WARPS * k for k in range(tt // CONSUMER_WARPS)]) for w in range(CONSUMER_WARPS)]
    calls += [(ch, list(range(r0, r0 + 4))) for ch in range(1, ntiles // X8_CHUNK) for r0 in range(0, tt, 4)]
    units, placed, reads, writes = set(), {}, {}, {}
    for ch, rows in calls:
        for lane in range(32):
            q, i = lane % 4, ch * X8_CHUNK + lane // 4
            for r in (r for r in rows if r < m):
                assert (r, i, q) not in units
                units.add((r, i, q))
                for c in range(4 * q, 4 * q + 4):
                    src = w8.x8_src(i, r, c, tt)
                    b = (c % 8) * 16  # the TMA's place of columns 8c ..: 64-column atoms rows first (_w8_x_stage)
                    atom = (c // 8) * (tt // 8) + r // 8
                    assert src == i * tt * 2 * K_TILE + atom * w8.ATOM_BYTES + (r % 8) * w8.ROW_BYTES + (
                        ((b // 16) ^ (r % 8)) << 4)
                    reads.setdefault((r, i), set()).update(range(src, src + 16))
                for d in (2 * q, 2 * q + 1):
                    dst = w8.x8_dst(i, r, d, tt)
                    for k in range(16):
                        col = 16 * d + k
                        assert (r, i, col) not in placed
                        placed[r, i, col] = dst + k
                        assert dst + k == i * tt * 2 * K_TILE + (r // 8) * 1024 + (r % 8) * 128 + (
                            ((col // 16) ^ (r % 8)) << 4) + col % 16
                    writes.setdefault((r, i), set()).update(range(dst, dst + 16))
    assert units == {(r, i, q) for r in range(m) for i in range(ntiles) for q in range(4)}
    assert set(placed) == {(r, i, col) for r in range(m) for i in range(ntiles) for col in range(K_TILE)}
    for g, wr in writes.items():
        assert wr <= reads[g]
    seen = set()
    for rd in reads.values():
        assert not rd & seen
        seen |= rd


# the e4m3 consumers' register mapping (w8.load_a2 / load_b, at w8.a_byte / b_byte), emulated lane by lane: the
# swizzled W and x stages as TMA writes them, ldmatrix.x4's distribution, load_b's 8-byte reads and mma.sync
# m16n8k16's register semantics; every m16 x n8 block of a k-tile must come out as W x^T (the k permutation is the
# same for A and B)
def _w8_w_stage(w8, w):  # [64, 128] bytes -> the 8 KiB stage: 16-byte chunks XOR row % 8
    out = w.new_zeros(w8.STAGE_BYTES)
    for r in range(HEAD_COLS):
        for c in range(K_TILE):
            out[r * w8.ROW_BYTES + (((c // 16) ^ (r % 8)) << 4) + c % 16] = w[r, c]
    return out


def _w8_x_stage(w8, x):  # [tt, 128] -> the stage in bf16 slots: 8 x 64 atoms rows first, chunks XOR row % 8
    tt = x.shape[0]
    out = x.new_zeros(tt * K_TILE)
    for n in range(tt):
        for c in range(K_TILE):
            b = (c % 64) * 2
            atom = (c // 64) * (tt // 8) + n // 8
            out[(atom * w8.ATOM_BYTES + (n % 8) * w8.ROW_BYTES + (((b // 16) ^ (n % 8)) << 4) + b % 16) // 2] = x[n, c]
    return out


@pytest.mark.parametrize("tt", [8, 16, 32])  # the e4m3 builds' token tiles: 1, 2 and 4
def test_w8_lane_mapping_gives_w_times_x(tt):
    pytest.importorskip("cutlass")
    import torch

    from musekern.kernels.qkv_front import w8

    g0 = torch.Generator().manual_seed(tt)
    # values standing for the bytes: only where each one goes matters
    w = torch.randn(HEAD_COLS, K_TILE, generator=g0, dtype=torch.float64)
    x = torch.randn(tt, K_TILE, generator=g0, dtype=torch.float64)
    sw, sx = _w8_w_stage(w8, w), _w8_x_stage(w8, x)
    got = torch.zeros(HEAD_COLS, tt, dtype=torch.float64)
    lanes = [w8.LaneRows(L) for L in range(32)]
    for row0 in range(0, HEAD_COLS, 16):
        for kk in range(0, K_TILE // 16, 2):
            addr = [w8.a_byte(0, row0, lr, kk) for lr in lanes]
            # ldmatrix.x4: matrix j's row i at lane 8j + i's address; lane (g, t) gets bytes 4t..4t+3 of row g
            d = [[sw[addr[8 * j + L // 4] + 4 * (L % 4):][:4] for j in range(4)] for L in range(32)]
            for step in (0, 1):
                k = kk + step
                a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, tt, dtype=torch.float64)
                for L in range(32):
                    g, t = L // 4, L % 4
                    lo, hi = d[L][2 * step], d[L][2 * step + 1]  # rows g, g + 8: a0, a2 halves / a1, a3 halves
                    a[g, [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]] = lo
                    a[g + 8, [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]] = hi
                    for nt in range(tt // 8):
                        byte = w8.b_byte(0, g, t, k, nt, tt)
                        b[[2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9], 8 * nt + g] = sx[byte // 2:byte // 2 + 4]
                got[row0:row0 + 16] += a @ b  # mma.sync: D += A B over the 16 register slots of the step
    torch.testing.assert_close(got, w @ x.T, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("v", [v for v in PLANNED_W8 if v.n in (2176, 17408)], ids=lambda v: v.label)
def test_w8_sass(kmod, v, tmp_path):
    import nvdump

    from musekern.kernels.qkv_front.rules import one_wave_at_two_per_sm

    ck, _ = _compile(kmod, v)
    usage = _no_local_memory(ck.cubin, tmp_path)
    s = nvdump.dump(ck.cubin, tmp_path, "-sass").stdout
    if v.warp_split == "wg":  # W8A8: FP8 wgmma on the ring's bytes (x quantized ahead: no conversion)
        assert f"QGMMA.64x{padded_tokens(v)}x32.F32.E4M3.E4M3" in s
        if v.kv_cache_dtype == "bf16":  # (an FP8 cache's stores convert too)
            assert ("F2FP.SATFINITE.E4M3.F32.PACK_AB" in s) == (v.x_dtype == "bf16")
        assert "HMMA" not in s and "F2FP.F16.E4M3.UNPACK_B" not in s and not re.search(r"\b(STL|LDL)\b", s)
        # one wgmma group kept in flight (mma.py WG8_RUN): ptxas serializes every wgmma to wait_group 0 where a
        # group crosses a dynamic loop's back edge (C7514)
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in s
        return
    # planned for two CTAs per SM (the 4-tile builds serve only where their CTAs are alone on their SMs: rules.py
    # W8_WIDE_TILES)
    if one_wave_at_two_per_sm(v.n, v.k_split, get_target("h200")) and v.tiles <= 2:
        assert CTAS_PER_SM * THREADS * ((usage["REG"] + 7) // 8 * 8) <= SM90_REGS_PER_SM
    # the exact conversion (research/fp8.md section 4): 4 SASS a pair
    assert "F2FP.F16.E4M3.UNPACK_B" in s and "F2FP.BF16.F32.PACK_AB" in s and "HADD2.F32" in s
    assert "HMMA.16816.F32.BF16" in s and "UTMALDG" in s
    assert not re.search(r"\b(STL|LDL)\b", s)
