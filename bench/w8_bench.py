"""Issue 30's check of the e4m3-weight front (M <= 16, 32 at TP8), in one H200 run: correctness first, then speed.

check: for each shard (TP8, TP4, TP2, TP1 of the bundled model), scale kind (channel, block) and M in --check-ms, the
  e4m3 build (launched by the loader) against the fp64 chain on the dequantized weight (y_gemm = bf16(x @ W^T) in
  fp64, then musekern.reference's norm, RoPE and inserts): y's max error no more than twice torch's own (cuBLAS bf16
  GEMM on the bf16-rounded dequantized weight, the same fp64 epilogue) + 1e-2, the caches' rows within the same bound
  and untouched outside the slots, two launches bit-identical; a W8A8 build ("wg": x quantized in the kernel) against
  the same chain on its own arithmetic (musekern.reference.w8a8_gemm's x, the GEMM exact): no more than that GEMM's
  fp32 sums (w8a8_gemm) + one bf16 step of the largest value; vLLM's chain's error (reference.vllm_fp8_gemm)
  beside. Weights: random e4m3 bytes over the whole finite range (subnormals included) with scales 2^U(-12, -4),
  x N(0, 1).
time: per shard and M in --ms, 8 layers of weights rotated past the L2, CUDA-graph replay, round-robin medians,
  chain (8 fronts with PDL on one x) and after-norm (an RMSNorm predecessor per layer; the front's share = total -
  predecessors): the bf16 front (the op), the e4m3 front (channel, block), and torch._scaled_mm alone (x already
  e4m3, per-token and per-row fp32 scales, bf16 out: cuBLAS's FP8 GEMM) in chain; floors at the copy bandwidth.
  Targets (issue 30): e4m3 / bf16 <= 0.60 at TP8 M = 1, 8, 16; e4m3 faster than _scaled_mm at TP8 and TP4; TP1
  M <= 16 at >= 90 % of copy bandwidth.

Usage (GPU machine, cache carried):
  source bench/device_env.sh && python3 bench/w8_bench.py --out $DEST/h100-w8-bench.json  (named for its GPU)
Table last on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from types import SimpleNamespace

import torch

from bench.harness import report
from bench.harness.pred import PredKernel
from bench.harness.qkv_front import chain_inputs
from bench.harness.timing import Graph, copy_bandwidth, log, loops_for, time_graphs
from bench.w8_labels import SHARDS, builds
from musekern.config import load_config
from musekern.kernels.qkv_front.variant import launch_grid
from musekern.model import HIDDEN
from musekern.ops import qkv_front as front
from musekern.ops import x_quant
from musekern.reference import (
    bf16_step,
    fused_qknorm_rope_kv_insert,
    rope_cos_sin_table,
    vllm_fp8_gemm,
    w8a8_gemm,
    w8a8_x_dequantized,
)
from musekern.runtime import get_kernel

LAYERS, BLOCK, MAX_POS = 8, 16, 4096
TP_OF = {2176: 8, 4352: 4, 8704: 2, 17408: 1}
SCALES = ("channel", "block")


def e4m3_weight(n: int, g) -> torch.Tensor:
    """Random finite e4m3 bytes (every exponent, subnormals and zeros included; no NaN 0x7f / 0xff)."""
    b = torch.randint(0, 256, (n, HIDDEN), dtype=torch.uint8, device="cuda", generator=g)
    b = torch.where((b & 0x7F) == 0x7F, b ^ 0x01, b)
    return b.view(torch.float8_e4m3fn)


def scales(n: int, kind: str, g) -> torch.Tensor:
    shape = (n // 64, 64) if kind == "block" else (n,)
    return torch.exp2(torch.empty(shape, device="cuda").uniform_(-12, -4, generator=g)).contiguous()


def dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 [N, 8192] of the canonical layout (musekern/weights/pack.py)."""
    wf = w.double()
    if s.dim() == 2:
        n = w.shape[0]
        return (wf.reshape(n // 64, 64, 64, 128) * s.double()[:, None, :, None]).reshape(n, HIDDEN)
    return wf * s.double()[:, None]


def launch(k, v, vals: dict) -> None:
    """Launch build v (loaded as k) with the values of `values`; a build reading x quantized ahead (x_dtype
    fp8_e4m3) gets x_quant's e4m3 x and scales first, as the op does."""
    if v.x_dtype != "bf16":
        q, s = x_quant.quantize(vals["x"], 128)
        vals = {**vals, "x": q, "x_scale": s.data_ptr()}
    k.launch_ordered(launch_grid(v), [vals[p] for p in k.param_names])


def values(x, w, sc, pos, cs, slots, kc, vc, eps, y) -> dict:
    """The launch values of an e4m3 build, by ABI name (kernels/qkv_front/abi.py)."""
    return {"weight": w, "x": x, "M": x.shape[0], "weight_scale": sc.data_ptr(), "y": y.data_ptr(),
            "positions": pos.data_ptr(), "cos_sin_cache": cs.data_ptr(), "slot_mapping": slots.data_ptr(),
            "key_cache": kc.data_ptr(), "value_cache": vc.data_ptr(), "max_pos": cs.shape[0],
            "block_size": kc.shape[1], "num_blocks": kc.shape[0], "k_block_stride": kc.stride(0),
            "v_block_stride": vc.stride(0), "eps": float(eps)}


def _caches(nkv: int, slots: int, g):
    blocks = math.ceil(slots / BLOCK) + 2
    kv = torch.randn((2, blocks, BLOCK, nkv, 64), device="cuda", generator=g).to(torch.bfloat16)
    return kv[0], kv[1], blocks * BLOCK


def check(n: int, nkv: int, kind: str, m: int, v, eps: float, theta: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(7 * n + m + (kind == "block"))
    k = get_kernel(v, device=0)
    w, sc = e4m3_weight(n, g), scales(n, kind, g)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    cs = rope_cos_sin_table(MAX_POS, theta, "cuda")
    pos = torch.randint(0, MAX_POS, (m,), device="cuda", generator=g)
    kc, vc, cap = _caches(nkv, m, g)
    slots = torch.randperm(cap, device="cuda", generator=g)[:m]
    if m > 2:
        slots[1] = -1  # a padded token: written nowhere
    wd = dequant(w, sc)
    yg = (x.double() @ wd.T).to(torch.bfloat16)
    yt = torch.mm(x, wd.to(torch.bfloat16).T)  # torch's own bf16 chain, the W8A16 builds' error yardstick
    packed = SimpleNamespace(weight=w, weight_scale=sc, n=n, fmt=SimpleNamespace(granularity=kind, ue8m0=False))
    yv = vllm_fp8_gemm(x, packed).to(torch.bfloat16)  # vLLM's W8A8 chain, recorded beside
    w8a8 = v.warp_split == "wg"  # x quantized in the kernel: held to its own arithmetic, exact and in fp32 sums
    chains = [("ref", yg), ("torch", yt), ("vllm", yv)]
    if w8a8:  # its own x's exact GEMM, and its exact sums rounded once (x quantized ahead: x_quant's quotients)
        ahead = v.x_dtype != "bf16"
        chains += [("model", (w8a8_x_dequantized(x, ahead) @ wd.T).to(torch.bfloat16)),
                   ("model_sums", w8a8_gemm(x, packed, ahead).to(torch.bfloat16))]
    outs = {}
    for name, yy in chains:
        kr, vr = kc.clone(), vc.clone()
        outs[name] = (fused_qknorm_rope_kv_insert(yy.clone(), pos, cs, slots, kr, vr, nkv, eps), kr, vr)
    if not w8a8:
        outs["model"] = outs["ref"]  # a W8A16 build's arithmetic is x @ W itself
    runs = []
    for _ in range(2):
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        k2, v2 = kc.clone(), vc.clone()
        launch(k, v, values(x, w, sc, pos, cs, slots, k2, v2, eps, y))
        torch.cuda.synchronize()
        runs.append((y, k2, v2))
    y, k2, v2 = runs[0]
    ref, kr, vr = outs["model"]  # the exact GEMM of the arithmetic the build performs (yg's unless W8A8)

    def err(a, b):
        return float((a.float() - b.float()).abs().max())

    e_y, e_kv = err(y, ref), max(err(k2, kr), err(v2, vr))
    gref, gkr, gvr = outs["ref"]  # torch's and vLLM's chains against the exact GEMM on x itself
    e_t, e_kv_t = err(outs["torch"][0], gref), max(err(outs["torch"][1], gkr), err(outs["torch"][2], gvr))
    e_v, e_kv_v = err(outs["vllm"][0], gref), max(err(outs["vllm"][1], gkr), err(outs["vllm"][2], gvr))
    if w8a8:  # its exact sums rounded once, plus one bf16 step of the largest value (fp32 sums in another order)
        e_m = err(outs["model_sums"][0], ref)
        e_kv_m = max(err(outs["model_sums"][1], kr), err(outs["model_sums"][2], vr))
        bound = e_m + bf16_step(float(ref.float().abs().max()))
        bound_kv = e_kv_m + bf16_step(max(float(kr.float().abs().max()), float(vr.float().abs().max())))
    else:
        bound, bound_kv = 2 * e_t + 1e-2, 2 * e_kv_t + 1e-2
    row = {"N": n, "tp": TP_OF[n], "scale": kind, "M": m, "build": v.label, "y_err": e_y, "torch_y_err": e_t,
           "vllm_y_err": e_v, "kv_err": e_kv, "torch_kv_err": e_kv_t, "vllm_kv_err": e_kv_v, "bound": bound,
           "against": "w8a8_gemm" if w8a8 else "x @ W",
           "deterministic": all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True)),
           "finite": bool(y.isfinite().all())}
    row["ok"] = bool(row["finite"] and row["deterministic"] and e_y <= bound and e_kv <= bound_kv)
    return row


def exact(n: int, nkv: int, m: int, v, eps: float, theta: float) -> dict:
    """Every finite e4m3 byte through the build's conversion: the gate heads' rows (y's raw columns) hold byte
    (row * m + t) % 256 at column k_t (NaN bytes 0x7f / 0xff -> 0), x token t is one-hot at k_t, channel scales 1:
    y[t, gate row] must be the byte's exact value (one nonzero product; bf16 holds every e4m3 value)."""
    g = torch.Generator(device="cuda").manual_seed(11 * n + m)
    k = get_kernel(v, device=0)
    heads = n // 64
    nq = (heads - 2 * nkv) // 2
    gate0 = (nq + 2 * nkv) * 64
    rows = n - gate0
    ks = torch.randperm(HIDDEN, device="cuda", generator=g)[:m]
    b = torch.zeros(n, HIDDEN, dtype=torch.uint8, device="cuda")
    val = ((torch.arange(rows, device="cuda")[:, None] * m + torch.arange(m, device="cuda")[None, :]) % 256)
    val = torch.where((val & 0x7F) == 0x7F, 0, val).to(torch.uint8)
    b[gate0:, ks] = val
    w = b.view(torch.float8_e4m3fn)
    x = torch.zeros(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(m, device="cuda"), ks] = 1.0
    sc = torch.ones(n, device="cuda")
    cs = rope_cos_sin_table(MAX_POS, theta, "cuda")
    pos = torch.zeros(m, dtype=torch.int64, device="cuda")
    kc, vc, _ = _caches(nkv, m, g)
    slots = torch.full((m,), -1, dtype=torch.int64, device="cuda")
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch(k, v, values(x, w, sc, pos, cs, slots, kc, vc, eps, y))
    torch.cuda.synchronize()
    want = val.view(torch.float8_e4m3fn).float().T.to(torch.bfloat16)  # [m, rows]
    got = y[:, gate0:]
    bad = int((got.float() != want.float()).sum())  # (byte 0x80, -0, sums to +0 from a +0 accumulator: equal)
    return {"N": n, "tp": TP_OF[n], "M": m, "build": v.label, "bytes": int(torch.unique(val).numel()),
            "mismatches": bad, "ok": bad == 0}


def timing(n: int, nkv: int, m: int, table: dict, eps: float, theta: float, pred, samples: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1000 * m + n)
    bf = torch.bfloat16
    cs, pos, x, res, gamma, xs = chain_inputs(m, theta, g)
    kc, vc, cap = _caches(nkv, m, g)
    slots = torch.randperm(cap, device="cuda", generator=g)[:m]
    o = torch.empty(LAYERS, m, n, dtype=bf, device="cuda")
    w8 = [e4m3_weight(n, g) for _ in range(LAYERS)]
    graphs = []
    seq_s = LAYERS * (report.floor_us(n, 4.0) * 1e-6)

    def add(name, call):  # call(x_j, j)
        graphs.append(Graph(f"chain_{name}", [(lambda j=j: call(x, j)) for j in range(LAYERS)], loops_for(seq_s),
                            LAYERS))
        graphs.append(Graph(f"after_norm_{name}", [f for j in range(LAYERS) for f in (
            (lambda j=j: pred.launch(res[j], gamma, xs[j], eps, pdl=True)), (lambda j=j: call(xs[j], j)))],
            loops_for(2 * seq_s), LAYERS))

    wb = [(torch.randn(n, HIDDEN, device="cuda", generator=g) * 0.02).to(bf) for _ in range(LAYERS)]
    front.prepare(n, [m], nkv)
    add("bf16", lambda xj, j: front.qkv_front(xj, wb[j], pos, cs, slots, kc, vc, nkv, eps, out=o[j]))
    for kind in SCALES:
        v = table[(n, "fp8_e4m3", kind, m)]
        sc = [scales(n, kind, g) for _ in range(LAYERS)]
        k = get_kernel(v, device=0)

        def call(xj, j, k=k, v=v, sc=sc):
            launch(k, v, values(xj, w8[j], sc[j], pos, cs, slots, kc, vc, eps, o[j]))
        add(f"fp8_{kind}", call)
    xq = x.to(torch.float8_e4m3fn)
    sx = torch.ones(m, 1, device="cuda")
    sw = [torch.rand(1, n, device="cuda", generator=g) + 0.5 for _ in range(LAYERS)]
    ys = torch.empty(LAYERS, m, n, dtype=bf, device="cuda")
    graphs.append(Graph("chain_scaled_mm", [(lambda j=j: torch._scaled_mm(
        xq, w8[j].T, scale_a=sx, scale_b=sw[j], out_dtype=bf, out=ys[j])) for j in range(LAYERS)], loops_for(seq_s),
        LAYERS))
    graphs.append(Graph("pred", [(lambda j=j: pred.launch(res[j], gamma, xs[j], eps, pdl=True))
                                 for j in range(LAYERS)], loops_for(LAYERS * 2e-6), LAYERS))
    t = time_graphs(graphs, samples)
    us = {kk: round(vv["us"], 3) for kk, vv in t.items()}
    for kk in list(us):
        if kk.startswith("after_norm_"):
            us[kk.replace("after_norm_", "front_after_norm_")] = round(us[kk] - us["pred"], 3)
    row = {"N": n, "tp": TP_OF[n], "M": m, "us": us,
           "fp8_floor_us": round(n * HIDDEN / 4.22e6, 2), "bf16_floor_us": round(2 * n * HIDDEN / 4.22e6, 2)}
    row["ratio"] = {f"{md}_{kind}": round(us[f"{pre}fp8_{kind}"] / us[f"{pre}bf16"], 3)
                    for kind in SCALES for md, pre in (("chain", "chain_"), ("after_norm", "front_after_norm_"))}
    row["vs_scaled_mm"] = {kind: round(us[f"chain_fp8_{kind}"] / us["chain_scaled_mm"], 3) for kind in SCALES}
    return row


def x_quant_exact(m: int, group: int) -> dict:
    """The x_quant kernel's bytes and scales (`group` 0: per token, 128: per group) against musekern.reference's
    (random rows at spread magnitudes, a zero row, a power-of-two scale's row)."""
    from musekern.gemm.fp8 import quantize_reference

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g) * torch.exp2(
        torch.randint(-20, 20, (m, 1), device="cuda", generator=g).float())
    x[0] = 0
    x[1].clamp_(-3584, 3584)
    x[1, 5] = 3584.0  # amax 448 * 8: s = 8, a power of two
    x = x.to(torch.bfloat16)
    q, s = x_quant.quantize(x, group)
    qr, sr = quantize_reference(x, group)
    bad = int((q.view(torch.uint8) != qr.view(torch.uint8)).sum()) + int((s != sr).sum())
    return {"M": m, "group": group, "mismatches": bad, "ok": bad == 0}


def layer_inputs(n: int, nkv: int, m: int, theta: float, seed: int):
    """A timing's inputs, drawn in this order from one generator seeded seed + m + n: (g, cos|sin table, positions,
    x, key / value caches, slots, the LAYERS outputs, LAYERS e4m3 weights, LAYERS bf16 weights)."""
    g = torch.Generator(device="cuda").manual_seed(seed + m + n)
    bf = torch.bfloat16
    cs = rope_cos_sin_table(MAX_POS, theta, "cuda")
    pos = torch.randint(0, MAX_POS, (m,), device="cuda", generator=g)
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(bf)
    kc, vc, cap = _caches(nkv, m, g)
    slots = torch.randperm(cap, device="cuda", generator=g)[:m]
    o = torch.empty(LAYERS, m, n, dtype=bf, device="cuda")
    w8 = [e4m3_weight(n, g) for _ in range(LAYERS)]
    wb = [(torch.randn(n, HIDDEN, device="cuda", generator=g) * 0.02).to(bf) for _ in range(LAYERS)]
    return g, cs, pos, x, kc, vc, slots, o, w8, wb


def add_scaled_mm(add, x, w8, o, g):
    """Add the graph "scaled_mm" (torch._scaled_mm alone: x already e4m3, unit per-token and random per-row fp32
    scales, bf16 out into o[j]); returns the e4m3 x."""
    m, n = x.shape[0], o.shape[2]
    xq = x.to(torch.float8_e4m3fn)
    sx = torch.ones(m, 1, device="cuda")
    sw = [torch.rand(1, n, device="cuda", generator=g) + 0.5 for _ in range(LAYERS)]
    add("scaled_mm", lambda j: torch._scaled_mm(xq, w8[j].T, scale_a=sx, scale_b=sw[j], out_dtype=torch.bfloat16,
                                                out=o[j]))
    return xq


def add_op_graphs(add, n: int, nkv: int, m: int, g, bf16_call, fp8_call):
    """Add the graphs "bf16" (bf16_call(j)) and "fp8_channel" / "fp8_block" (fp8_call(j, layer j's weight_scale), the
    scales drawn from g in that order), each after front.prepare of its weight format."""
    front.prepare(n, [m], nkv)
    add("bf16", bf16_call)
    for kind in SCALES:
        front.prepare(n, [m], nkv, weight_format=f"fp8-{kind}")
        sc = [scales(n, kind, g) for _ in range(LAYERS)]
        add(f"fp8_{kind}", lambda j, sc=sc: fp8_call(j, sc[j]))


def gemm_timing(n: int, nkv: int, m: int, eps: float, theta: float, samples: int) -> dict:
    """The op's FP8 GEMM path (ops.qkv_front.launch_gemm_epilogue, whatever M the front serves: x_quant per token /
    per group + _scaled_mm row-wise / block-scaled + the fused epilogue) beside the bf16 op and _scaled_mm alone (x
    already e4m3; the block form too where torch serves it), 8 layers rotated, CUDA-graph replay."""
    from musekern.gemm import fp8 as gemm_fp8
    from musekern.ops import qkv_epilogue

    g, cs, pos, x, kc, vc, slots, o, w8, wb = layer_inputs(n, nkv, m, theta, 5000)
    graphs = []
    seq_s = LAYERS * 2 * m * n * HIDDEN / 600e12

    def add(name, call):
        graphs.append(Graph(name, [(lambda j=j: call(j)) for j in range(LAYERS)], loops_for(seq_s), LAYERS))

    add_op_graphs(add, n, nkv, m, g, lambda j: front.qkv_front(x, wb[j], pos, cs, slots, kc, vc, nkv, eps, out=o[j]),
                  lambda j, sc: front.launch_gemm_epilogue(x, w8[j], pos, cs, slots, kc, vc, nkv, eps, o[j],
                                                           weight_scale=sc))
    xq = add_scaled_mm(add, x, w8, o, g)
    block_mm = gemm_fp8.block_scaled_mm(x.device)  # the block path's GEMM alone (x already quantized per group)
    if block_mm is not None:
        sxg = torch.ones(HIDDEN // 128, m, device="cuda").t()
        swb = [gemm_fp8.weight_scales_per_row(scales(n, "block", g)) for _ in range(LAYERS)]
        add("scaled_mm_block", lambda j: block_mm(xq, w8[j], sxg, swb[j], o[j]))
    add("epilogue", lambda j: qkv_epilogue.launch(o[j], pos, cs, slots, kc, vc, nkv, eps))
    t = time_graphs(graphs, samples)
    us = {kk: round(vv["us"], 3) for kk, vv in t.items()}
    return {"N": n, "tp": TP_OF[n], "M": m, "us": us,
            "channel_over_scaled_mm": round(us["fp8_channel"] / us["scaled_mm"], 3),
            "channel_over_bf16": round(us["fp8_channel"] / us["bf16"], 3),
            "block_over_bf16": round(us["fp8_block"] / us["bf16"], 3),
            "block_over_scaled_mm_block": (round(us["fp8_block"] / us["scaled_mm_block"], 3)
                                           if "scaled_mm_block" in us else None)}


def table_text(doc: dict) -> str:
    lines = [f"exact (every e4m3 byte): {sum(r['mismatches'] for r in doc['exact'])} mismatches in "
             f"{len(doc['exact'])} builds; x_quant against the reference: "
             f"{sum(r['mismatches'] for r in doc['x_quant'])} mismatches",
             "check: shard scale M  y_err (torch / vLLM) kv_err  bound  ok"]
    for r in doc["check"]:
        lines.append(f"  TP{r['tp']} {r['scale']:7s} {r['M']:2d}  {r['y_err']:.4f} ({r['torch_y_err']:.4f} / "
                     f"{r['vllm_y_err']:.4f}) {r['kv_err']:.4f}  {r['bound']:.4f} {r['ok']}")
    lines.append("time (us): TP M | bf16 chain | fp8 ch/blk chain | ratio ch/blk | after-norm ratio ch/blk | "
                 "scaled_mm | floor8")
    for r in doc["timing"]:
        u, q = r["us"], r["ratio"]
        lines.append(f"  TP{r['tp']} {r['M']:2d} | {u['chain_bf16']:.2f} | {u['chain_fp8_channel']:.2f} / "
                     f"{u['chain_fp8_block']:.2f} | {q['chain_channel']:.3f} / {q['chain_block']:.3f} | "
                     f"{q['after_norm_channel']:.3f} / {q['after_norm_block']:.3f} | {u['chain_scaled_mm']:.2f} | "
                     f"{r['fp8_floor_us']}")
    lines.append("GEMM path (us): TP M | bf16 op | fp8 channel / block | scaled_mm alone row / block | epilogue | "
                 "ch/row blk/block")
    for r in doc["gemm"]:
        u = r["us"]
        lines.append(f"  TP{r['tp']} {r['M']:5d} | {u['bf16']:.1f} | {u['fp8_channel']:.1f} / {u['fp8_block']:.1f} | "
                     f"{u['scaled_mm']:.1f} / {u.get('scaled_mm_block')} | {u['epilogue']:.1f} | "
                     f"{r['channel_over_scaled_mm']:.3f} {r['block_over_scaled_mm_block']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/h100-w8-bench.json")
    ap.add_argument("--check-ms", default="1,2,7,8,9,16,17,32", help="M values checked where a shard's e4m3 front "
                    "serves them (17, 32: TP8's 4-tile build)")
    ap.add_argument("--ms", default="1,4,8,16,32", help="M values timed where a shard's e4m3 front serves them "
                    "(4: inside TP8's W8A8 one-tile build)")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--gemm-ms", default="64,1024,8192", help="M values of the GEMM path timing ('' for none)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("w8_bench: needs a CUDA GPU; run it on the GPU machine with the cache carried", file=sys.stderr)
        return 2
    model = load_config()
    torch.zeros(1, device="cuda")
    pred = PredKernel()
    t0 = time.time()
    table = builds()
    doc = dict(report.commit_info(), device=torch.cuda.get_device_name(), torch=torch.__version__,
               time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), layers=LAYERS, samples=a.samples,
               copy_TBps=copy_bandwidth(), exact=[], check=[], x_quant=[], timing=[], gemm=[])
    eps, theta = model.rms_norm_eps, model.rope_theta

    def save() -> None:  # after each part: a cut run still leaves what it measured ("ok" over the checks so far)
        doc["ok"] = all(r["ok"] for r in doc["check"] + doc["exact"] + doc["x_quant"])
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)

    for n, nkv in SHARDS:
        for m in (1, 8, 16):
            r = exact(n, nkv, m, table[(n, "fp8_e4m3", "channel", m)], eps, theta)
            doc["exact"].append(r)
            log(f"exact TP{r['tp']} M={m}: {r['bytes']} bytes, {r['mismatches']} mismatches")
        for kind in SCALES:
            for m in (int(s) for s in a.check_ms.split(",") if (n, "fp8_e4m3", kind, int(s)) in table):
                r = check(n, nkv, kind, m, table[(n, "fp8_e4m3", kind, m)], eps, theta)
                doc["check"].append(r)
                log(f"{time.time() - t0:6.1f}s check TP{r['tp']} {kind} M={m}: y {r['y_err']:.4f} "
                    f"(torch {r['torch_y_err']:.4f}) kv {r['kv_err']:.4f} ok={r['ok']}")
    save()
    for n, nkv in () if a.no_time else SHARDS:
        for m in (int(s) for s in a.ms.split(",") if (n, "fp8_e4m3", "channel", int(s)) in table):
            r = timing(n, nkv, m, table, eps, theta, pred, a.samples)
            doc["timing"].append(r)
            log(f"{time.time() - t0:6.1f}s time TP{r['tp']} M={m}: {r['us']}")
        torch.cuda.empty_cache()
        save()
    for group in (0, 128):
        r = x_quant_exact(1000, group)
        doc["x_quant"].append(r)
        log(f"x_quant M=1000 group={group}: {r['mismatches']} mismatches")
    for n, nkv in () if a.no_time or not a.gemm_ms else (SHARDS[0], SHARDS[-1]):
        for m in (int(s) for s in a.gemm_ms.split(",")):
            r = gemm_timing(n, nkv, m, eps, theta, a.samples)
            doc["gemm"].append(r)
            log(f"{time.time() - t0:6.1f}s gemm TP{r['tp']} M={m}: {r['us']}")
        torch.cuda.empty_cache()
        save()
    save()
    print(table_text(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
