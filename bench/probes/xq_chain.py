"""Probe (issue 30): what x quantized ahead of the front costs, x_quant launched with PDL (branch issue30-xq-pdl).

The lever this prices: a W8A8 front reading e4m3 x that x_quant wrote (per token and 128-group, vLLM's bytes) instead
of quantizing x itself (the planned "wg" build, paced by its quantizer above M = 4). Its kernel side is bounded by
the QGMMA probe (h100-e4m3-bounds.json `wgmma_bound`: TP8 M = 1-8 0.545-0.553 of the bf16 front, chained); the
other side is x_quant's latency where the front cannot hide it. Here: per layer, x_quant (group 128, PDL: it waits
for its predecessor, then lets the front launch and prefetch its weights) then the planned e4m3 front (channel
scales, reading the bf16 x: the dependency and the launch chain are the real ones, the front's work is today's),
against the front alone and x_quant alone; chained (8 layers on one x) and after a norm (an RMSNorm predecessor a
layer). "exposed" = (x_quant + front) - front: what the pre-quantized design adds to its kernel bound.

Usage (GPU machine, cache built from this tree): source bench/device_env.sh && python3 bench/probes/xq_chain.py
"""
from __future__ import annotations

import json
import sys

import torch

from bench.harness import report
from bench.harness.pred import PredKernel
from bench.harness.qkv_front import chain_inputs
from bench.harness.timing import Graph, loops_for, time_graphs
from bench.w8_bench import LAYERS, _caches, e4m3_weight, scales
from musekern.config import load_config
from musekern.model import HIDDEN
from musekern.ops import qkv_front as front
from musekern.ops import x_quant

N, NKV = 2176, 1  # TP8
MS = (1, 4, 8, 16)


def run(m: int, pred, eps: float, theta: float, samples: int = 30) -> dict:
    g = torch.Generator(device="cuda").manual_seed(77 + m)
    bf = torch.bfloat16
    cs, pos, x, res, gamma, xs = chain_inputs(m, theta, g)
    kc, vc, cap = _caches(NKV, m, g)
    slots = torch.randperm(cap, device="cuda", generator=g)[:m]
    o = torch.empty(LAYERS, m, N, dtype=bf, device="cuda")
    w8 = [e4m3_weight(N, g) for _ in range(LAYERS)]
    sc = [scales(N, "channel", g) for _ in range(LAYERS)]
    wb = [(torch.randn(N, HIDDEN, device="cuda", generator=g) * 0.02).to(bf) for _ in range(LAYERS)]
    front.prepare(N, [m], NKV)
    front.prepare(N, [m], NKV, weight_format="fp8-channel")
    x_quant.prepare(0, 128)
    seq_s = LAYERS * (report.floor_us(N, 4.0) * 1e-6)
    graphs = []

    def fp8(xj, j):
        front.qkv_front(xj, w8[j], pos, cs, slots, kc, vc, NKV, eps, out=o[j], weight_scale=sc[j])

    calls = {
        "bf16": lambda xj, j: front.qkv_front(xj, wb[j], pos, cs, slots, kc, vc, NKV, eps, out=o[j]),
        "fp8": fp8,
        "xq": lambda xj, j: x_quant.quantize(xj, 128),
        "xq_fp8": lambda xj, j: (x_quant.quantize(xj, 128), fp8(xj, j)),
    }
    for name, call in calls.items():
        graphs.append(Graph(f"chain_{name}", [(lambda j=j, c=call: c(x, j)) for j in range(LAYERS)],
                            loops_for(seq_s), LAYERS))
        graphs.append(Graph(f"after_norm_{name}", [f for j in range(LAYERS) for f in (
            (lambda j=j: pred.launch(res[j], gamma, xs[j], eps, pdl=True)), (lambda j=j, c=call: c(xs[j], j)))],
            loops_for(2 * seq_s), LAYERS))
    graphs.append(Graph("pred", [(lambda j=j: pred.launch(res[j], gamma, xs[j], eps, pdl=True))
                                 for j in range(LAYERS)], loops_for(LAYERS * 2e-6), LAYERS))
    t = time_graphs(graphs, samples)
    us = {k: round(v["us"], 3) for k, v in t.items()}
    row = {"M": m, "us": us}
    for md in ("chain", "after_norm"):
        row[f"{md}_exposed_us"] = round(us[f"{md}_xq_fp8"] - us[f"{md}_fp8"], 3)
        row[f"{md}_fp8_over_bf16"] = round(us[f"{md}_fp8"] / us[f"{md}_bf16"], 3)
    return row


def main() -> int:
    model = load_config()
    pred = PredKernel()
    doc = dict(report.commit_info(), device=torch.cuda.get_device_name(), rows=[])
    for m in MS:
        doc["rows"].append(run(m, pred, model.rms_norm_eps, model.rope_theta))
    json.dump(doc, sys.stderr)
    print("\nTP8 M | chain: bf16 fp8 xq xq+fp8 exposed | after a norm: bf16 fp8 xq xq+fp8 exposed (pred) (us)")
    for r in doc["rows"]:
        u = r["us"]
        print(f"  {r['M']:2d} | " + " | ".join(
            f"{u[md + '_bf16']:.2f} {u[md + '_fp8']:.2f} {u[md + '_xq']:.2f} {u[md + '_xq_fp8']:.2f} "
            f"{r[md + '_exposed_us']:.2f}" for md in ("chain", "after_norm")) + f" ({u['pred']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
