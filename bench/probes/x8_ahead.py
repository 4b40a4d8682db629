"""Probe (issue 30, branch issue30-x8-ahead): the W8A8 front reading x quantized ahead by x_quant.

The builds: TP8's e4m3 wgmma builds (W8A8, "wg") with x_dtype fp8_e4m3, one and two token tiles (M = 1-8, 9-16), the
in-kernel W8A8 build's ring (10 stages, late trigger 10 ahead). Each call: x_quant (group 128, PDL) then the front,
which reads the e4m3 x and its scales as x_quant left them (vLLM's block-path x: per token and 128-group).

check: y and the written K / V rows against the exact GEMM of that x (reference.quantize_x_per_group dequantized,
times the dequantized weight, fp64; then musekern.reference's norm / RoPE / inserts): within that GEMM's fp32 sums +
one bf16 step of the largest value (bench/w8_bench.py's W8A8 bound); vLLM's chain's error beside; two launches
bit-identical.
time: 8 layers rotated, CUDA-graph replay, chain and after a norm, beside the bf16 op and the planned e4m3 op.

Usage: here `python3 bench/probes/x8_ahead.py labels` (for `musekern prepare --variant`); on the GPU machine
`source bench/device_env.sh && python3 bench/probes/x8_ahead.py run` (table last).
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from musekern.kernels.qkv_front import rules
from musekern.kernels.qkv_front.variant import QkvFrontVariant
from musekern.targets import get_target

TP = int(os.environ.get("X8_TP", "8"))  # X8_TP=1: TP1 (N = 17408), one token tile, builds not planned
N, NKV = {8: (2176, 1), 1: (17408, 8)}[TP]
KINDS = ("channel", "block")
CHECK_MS = (1, 5, 8, 9, 16) if TP == 8 else (1, 5, 8)
TIME_MS = (1, 4, 8, 16) if TP == 8 else (1, 4, 8)
TILES = (1, 2) if TP == 8 else (1,)
TP1_STAGES = 19  # x's e4m3 slots (64 KiB) up front leave 19 e4m3 W stages in 227 KiB


def build(kind: str, tiles: int) -> QkvFrontVariant:
    """The x-ahead build the rules plan at TP8 (tiles 1: M = 1-8, 2: M = 9-16); at TP1 one tile, k_split 1, the
    deepest ring that fits, the W8A16 build's trigger."""
    if TP == 1:
        return QkvFrontVariant(N, NKV, 1, TP1_STAGES, 1, 0, "early", warp_split="wg", weight_dtype="fp8_e4m3",
                               weight_scale=kind, x_dtype="fp8_e4m3")
    return rules.variant(N, 8 * tiles, NKV, get_target("h200"), weight_dtype="fp8_e4m3", weight_scale=kind)


def before(kind: str, m: int) -> QkvFrontVariant:
    """The build main's rules gave M before (bench/results/h100-w8-bench.json): W8A8 in the kernel at M <= 7, W8A16
    "k" at 8 (fixed) and 9-16."""
    kw = dict(weight_dtype="fp8_e4m3", weight_scale=kind)
    if TP == 1:
        return rules.variant(N, m, NKV, get_target("h200"), **kw)
    if m <= 7:
        return QkvFrontVariant(N, NKV, 1, 10, 2, 0, "late", warp_split="wg", trigger_ahead=10, **kw)
    if m == 8:
        return QkvFrontVariant(N, NKV, 1, 10, 2, 8, "late", warp_split="k", trigger_ahead=10, **kw)
    return QkvFrontVariant(N, NKV, 2, 8, 2, 0, "late", warp_split="k", trigger_ahead=8, **kw)


def run() -> int:
    import torch

    from bench.harness import report
    from bench.harness.pred import PredKernel
    from bench.harness.qkv_front import chain_inputs
    from bench.harness.timing import Graph, loops_for, time_graphs
    from bench.w8_bench import LAYERS, MAX_POS, _caches, dequant, e4m3_weight, scales, values
    from musekern.config import load_config
    from musekern.kernels.qkv_front.variant import launch_grid
    from musekern.model import HIDDEN
    from musekern.ops import qkv_front as front
    from musekern.ops import x_quant
    from musekern.reference import (
        _group_scaled_sums,
        bf16_step,
        fused_qknorm_rope_kv_insert,
        quantize_x_per_group,
        rope_cos_sin_table,
        vllm_fp8_gemm,
    )
    from musekern.runtime import get_kernel

    model = load_config()
    eps, theta = model.rms_norm_eps, model.rope_theta
    kernels = {(kind, t): (get_kernel(build(kind, t), device=0), launch_grid(build(kind, t)))
               for kind in KINDS for t in TILES}
    x_quant.prepare(0, 128)

    def launch(kg, x, w, sc, pos, cs, slots, kc, vc, y):
        q, s = x_quant.quantize(x, 128)
        vals = values(q, w, sc, pos, cs, slots, kc, vc, eps, y)
        vals["x_scale"] = s.data_ptr()
        kg[0].launch_ordered(kg[1], [vals[p] for p in kg[0].param_names])

    doc = dict(report.commit_info(), device=torch.cuda.get_device_name(), check=[], timing=[])
    for kind in KINDS:
        for m in CHECK_MS:
            g = torch.Generator(device="cuda").manual_seed(7 * N + m + (kind == "block"))
            k = kernels[kind, 1 if m <= 8 else 2]
            w, sc = e4m3_weight(N, g), scales(N, kind, g)
            x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
            cs = rope_cos_sin_table(MAX_POS, theta, "cuda")
            pos = torch.randint(0, MAX_POS, (m,), device="cuda", generator=g)
            kc, vc, cap = _caches(NKV, m, g)
            slots = torch.randperm(cap, device="cuda", generator=g)[:m]
            if m > 2:
                slots[1] = -1
            packed = SimpleNamespace(weight=w, weight_scale=sc, n=N, fmt=SimpleNamespace(granularity=kind,
                                                                                       ue8m0=False))
            q, s = quantize_x_per_group(x)
            xd = (q.double().reshape(m, 64, 128) * s.double()[..., None]).reshape(m, HIDDEN)
            outs = {}
            for name, yy in (("model", (xd @ dequant(w, sc).T).to(torch.bfloat16)),
                             ("sums", _group_scaled_sums(q, s, packed).to(torch.bfloat16)),
                             ("vllm", vllm_fp8_gemm(x, packed).to(torch.bfloat16)),
                             ("exact", (x.double() @ dequant(w, sc).T).to(torch.bfloat16))):
                kr, vr = kc.clone(), vc.clone()
                outs[name] = (fused_qknorm_rope_kv_insert(yy.clone(), pos, cs, slots, kr, vr, NKV, eps), kr, vr)
            runs = []
            for _ in range(2):
                y = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device="cuda")
                k2, v2 = kc.clone(), vc.clone()
                launch(k, x, w, sc, pos, cs, slots, k2, v2, y)
                torch.cuda.synchronize()
                runs.append((y, k2, v2))

            def err(a, b):
                return float((a.float() - b.float()).abs().max())

            ref = outs["model"]
            e = [err(runs[0][i], ref[i]) for i in range(3)]
            e_s = [err(outs["sums"][i], ref[i]) for i in range(3)]
            bound = [e_s[i] + bf16_step(float(ref[i].float().abs().max())) for i in range(3)]
            row = {"kind": kind, "M": m, "err": e, "bound": bound,
                   "vllm_y_err": err(outs["vllm"][0], outs["exact"][0]), "y_err_exact": err(runs[0][0],
                                                                                          outs["exact"][0]),
                   "deterministic": all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True)),
                   "finite": bool(runs[0][0].isfinite().all())}
            row["ok"] = row["finite"] and row["deterministic"] and all(a <= b for a, b in zip(e, bound, strict=True))
            doc["check"].append(row)
            print(f"check {kind} M={m}: y/k/v err {e} bound {[round(b, 3) for b in bound]} ok={row['ok']}",
                  file=sys.stderr)
    pred = PredKernel()

    def time_one(m):
        g = torch.Generator(device="cuda").manual_seed(1000 * m + N)
        bf = torch.bfloat16
        cs, pos, x, res, gamma, xs = chain_inputs(m, theta, g)
        kc, vc, cap = _caches(NKV, m, g)
        slots = torch.randperm(cap, device="cuda", generator=g)[:m]
        o = torch.empty(LAYERS, m, N, dtype=bf, device="cuda")
        w8 = [e4m3_weight(N, g) for _ in range(LAYERS)]
        wb = [(torch.randn(N, HIDDEN, device="cuda", generator=g) * 0.02).to(bf) for _ in range(LAYERS)]
        seq_s = LAYERS * (report.floor_us(N, 4.0) * 1e-6)
        graphs = []

        def add(name, call):
            graphs.append(Graph(f"chain_{name}", [(lambda j=j: call(x, j)) for j in range(LAYERS)], loops_for(seq_s),
                                LAYERS))
            graphs.append(Graph(f"after_norm_{name}", [f for j in range(LAYERS) for f in (
                (lambda j=j: pred.launch(res[j], gamma, xs[j], eps, pdl=True)), (lambda j=j: call(xs[j], j)))],
                loops_for(2 * seq_s), LAYERS))

        front.prepare(N, [m], NKV)
        add("bf16", lambda xj, j: front.qkv_front(xj, wb[j], pos, cs, slots, kc, vc, NKV, eps, out=o[j]))
        for kind in KINDS:
            sc = [scales(N, kind, g) for _ in range(LAYERS)]
            front.prepare(N, [m], NKV, weight_format=f"fp8-{kind}")
            add(f"op_{kind}", lambda xj, j, sc=sc: front.qkv_front(xj, w8[j], pos, cs, slots, kc, vc, NKV, eps,
                                                                  out=o[j], weight_scale=sc[j]))
            k = kernels[kind, 1 if m <= 8 else 2]
            add(f"ahead_{kind}", lambda xj, j, sc=sc, k=k: launch(k, xj, w8[j], sc[j], pos, cs, slots, kc, vc, o[j]))
            b = before(kind, m)
            kb = (get_kernel(b, device=0), launch_grid(b))

            def old(xj, j, sc=sc, kb=kb):
                vals = values(xj, w8[j], sc[j], pos, cs, slots, kc, vc, eps, o[j])
                kb[0].launch_ordered(kb[1], [vals[p] for p in kb[0].param_names])
            add(f"before_{kind}", old)
        graphs.append(Graph("pred", [(lambda j=j: pred.launch(res[j], gamma, xs[j], eps, pdl=True))
                                     for j in range(LAYERS)], loops_for(LAYERS * 2e-6), LAYERS))
        t = time_graphs(graphs, 30)
        us = {kk: round(vv["us"], 3) for kk, vv in t.items()}
        for kk in list(us):
            if kk.startswith("after_norm_"):
                us[kk.replace("after_norm_", "front_after_norm_")] = round(us[kk] - us["pred"], 3)
        ratio = {f"{md}_{b}_{kind}": round(us[f"{pre}{b}_{kind}"] / us[f"{pre}bf16"], 3)
                 for b in ("before", "ahead", "op") for kind in KINDS
                 for md, pre in (("chain", "chain_"), ("after_norm", "front_after_norm_"))}
        return {"M": m, "us": us, "ratio": ratio}

    doc["timing"] = [time_one(m) for m in TIME_MS]
    json.dump(doc, sys.stderr)
    print("\ncheck: kind M | y k v err | bound | ok")
    for r in doc["check"]:
        print(f"  {r['kind']:7s} {r['M']:2d} | {' '.join(f'{e:.3f}' for e in r['err'])} | "
              f"{' '.join(f'{b:.3f}' for b in r['bound'])} | {r['ok']} (vLLM y {r['vllm_y_err']:.2f}, "
              f"this y {r['y_err_exact']:.2f} against x @ W)")
    print(f"time: TP{TP} M | bf16 chain | e4m3 / bf16, chain (after a norm), ch / blk: before | ahead | "
          "ahead by the op")
    for r in doc["timing"]:
        q = r["ratio"]
        print(f"  {r['M']:2d} | {r['us']['chain_bf16']:.2f} | " + " | ".join(
            f"{q[f'chain_{b}_channel']:.3f} / {q[f'chain_{b}_block']:.3f} ({q[f'after_norm_{b}_channel']:.3f} / "
            f"{q[f'after_norm_{b}_block']:.3f})" for b in ("before", "ahead", "op")))
    return 0


def main() -> int:
    if sys.argv[1:] == ["labels"]:
        labels = [build(kind, t).label for kind in KINDS for t in TILES]
        labels += [before(kind, m).label for kind in KINDS for m in TIME_MS]
        print("\n".join(dict.fromkeys(labels)))
        return 0
    if sys.argv[1:] == ["run"]:
        return run()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
