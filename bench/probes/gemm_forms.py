"""Which FP8 GEMM form the GEMM path should take above the front, and where torch's block-scaled one faults in graph
replay (bench/NOTES.md "e4m3 weights"). Round 75 (H100, h100-w8-all-m.json): at TP8 M = 33-128 the channel path takes
25.8-26.1 us because row-wise `_scaled_mm` alone is 22.0, while the block path's 1x128 GEMM took 11.7 at M = 64.

Per shard and M, 8 layers rotated, CUDA-graph replay, x already quantized (the GEMM alone):
  rowwise     _scaled_mm, per-token x scale [M, 1], per-row weight scale [1, N] (the channel path's GEMM today)
  block4/8/16 _scaled_mm 1x128 x 1x128 blocks, M padded to a multiple of 4 / 8 / 16 (block4 is the block path's today),
              the weight scales [K / 128, N] (channel scales repeated over K are these exactly)
              (the own cuBLASLt call of the same form, lt4/8/16, ran to 6811d37: it faulted in replay too)
and the whole product path (ops.qkv_front.launch_gemm_epilogue: x_quant + GEMM + epilogue) for channel and block
scales as it is on this tree. Prints one table last: us per layer, and the best block form over rowwise.

GPU machine, cache carried: python3 bench/probes/gemm_forms.py [--ms 33,40,...] [--tps 8,4,1] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench.harness import report
from bench.harness.timing import Graph, log, loops_for, time_graphs
from bench.w8_all_m import SHARDS
from bench.w8_bench import LAYERS, TP_OF, add_op_graphs, layer_inputs
from musekern.config import load_config
from musekern.gemm import fp8 as gemm_fp8
from musekern.model import HIDDEN
from musekern.ops import qkv_front as front

MS = (33, 36, 40, 44, 48, 52, 56, 60, 64, 72, 96, 100, 128, 256, 1024, 4096)  # round 75's slow range, its % 8 split,
# and the large M the GEMM path's target is stated at
PADS = (4, 8, 16)
FORM_V2 = os.environ.get("FORMS_V2") == "1"  # the block GEMM through torch.nn.functional.scaled_mm (the v2 form)


def measure(n: int, nkv: int, m: int, eps: float, theta: float, samples: int, loops: int = 0,
            eager: bool = False, locate: bool = False, only: tuple = ()) -> dict:
    g, cs, pos, x, kc, vc, slots, o, w8, wb = layer_inputs(n, nkv, m, theta, 9000)
    graphs = []
    loops = loops or loops_for(LAYERS * max(n * HIDDEN / 3e12, 2 * m * n * HIDDEN / 600e12))

    def add(name, call):
        if only and name not in only:
            return
        log(f"  {name}")
        if eager:  # each layer's call once, no graph (compute-sanitizer with torch's caching allocator off)
            for j in range(LAYERS):
                call(j)
            torch.cuda.synchronize()
            return
        graphs.append(Graph(name, [(lambda j=j: call(j)) for j in range(LAYERS)], loops, LAYERS))
        torch.cuda.synchronize()

    if m <= 128:  # the product path as it is (the all-M run has it at every M)
        add_op_graphs(add, n, nkv, m, g, lambda j: front.launch(x, wb[j], pos, cs, slots, kc, vc, nkv, eps, out=o[j]),
                      lambda j, sc: front.launch_gemm_epilogue(x, w8[j], pos, cs, slots, kc, vc, nkv, eps, o[j],
                                                               weight_scale=sc))
    sw = [torch.rand(1, n, device="cuda", generator=g) + 0.5 for _ in range(LAYERS)]
    xq = x.to(torch.float8_e4m3fn)
    add("rowwise", lambda j: torch._scaled_mm(xq, w8[j].T, scale_a=torch.ones(m, 1, device="cuda"), scale_b=sw[j],
                                              out_dtype=torch.bfloat16, out=o[j]))
    block = gemm_fp8._block_scaled_mm_v2 if FORM_V2 else gemm_fp8.block_scaled_mm(x.device)
    if block is not None:
        swb = [s.expand(HIDDEN // 128, n).contiguous() for s in sw]  # channel scales as 1x128 blocks
        for pad in PADS:
            rows = -(-m // pad) * pad
            q = torch.cat([xq, torch.zeros(rows - m, HIDDEN, dtype=xq.dtype, device="cuda")])
            sx = torch.ones(HIDDEN // 128, rows, device="cuda").t()
            y = [torch.empty(rows, n, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
            add(f"block{pad}", lambda j, q=q, sx=sx, y=y: block(q, w8[j], sx, swb[j], y[j]))
    for gr in graphs if locate else ():  # each replayed alone first: a fault names its graph
        log(f"  replay {gr.name}")
        gr.replay()
        torch.cuda.synchronize()
    us = {k: round(v["us"], 3) for k, v in time_graphs(graphs, samples).items()} if graphs else {}
    best = min((k for k in us if k.startswith("block")), key=us.get, default=None)
    if best is None or "rowwise" not in us:
        return {"tp": TP_OF[n], "N": n, "M": m, "us": us, "best_block": None, "best_block_over_rowwise": None}
    return {"tp": TP_OF[n], "N": n, "M": m, "us": us, "best_block": best,
            "best_block_over_rowwise": round(us[best] / us["rowwise"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--tps", default="8,4,1")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--loops", type=int, default=0, help="layer sequences a graph holds (default: ~1.5 ms a replay)")
    ap.add_argument("--eager", action="store_true", help="each call once, no graphs, no timing (for memcheck with "
                    "PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor its own allocation)")
    ap.add_argument("--locate", action="store_true", help="replay and synchronize each graph alone before timing")
    ap.add_argument("--keep-cache", action="store_true", help="no torch.cuda.empty_cache() between Ms")
    ap.add_argument("--only", default="", help="the graphs to build, comma-separated (default: every one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = load_config()
    doc = dict(report.commit_info(), device=torch.cuda.get_device_name(), torch=torch.__version__, rows=[])
    for tp in (int(t) for t in a.tps.split(",")):
        n, nkv = next(s for s in SHARDS if TP_OF[s[0]] == tp)
        for m in (int(s) for s in a.ms.split(",")):
            try:
                log(f"TP{tp} M={m}")
                r = measure(n, nkv, m, model.rms_norm_eps, model.rope_theta, a.samples, a.loops, a.eager, a.locate,
                            tuple(filter(None, a.only.split(","))))
                if not a.keep_cache:
                    torch.cuda.empty_cache()
                torch.cuda.synchronize()
            except torch.AcceleratorError as e:  # sticky: stop, keep what ran
                doc["fault"] = {"tp": tp, "M": m, "error": str(e).splitlines()[0]}
                log(f"TP{tp} M={m}: {doc['fault']['error']}")
                break
            doc["rows"].append(r)
            log(f"TP{tp} M={m}: {r['us']}")
            if a.out:  # after each M: a cut run keeps its rows
                with open(a.out, "w") as f:
                    json.dump(doc, f, indent=1)
        if "fault" in doc:
            break
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    cols = ["bf16", "fp8_channel", "fp8_block", "rowwise"] + [f"{f}{p}" for f in ("block", "lt") for p in PADS]
    print("TP    M | " + " ".join(f"{c:>11s}" for c in cols) + " | best block/rowwise")
    for r in doc["rows"]:
        print(f"TP{r['tp']} {r['M']:4d} | " + " ".join(f"{r['us'].get(c, float('nan')):11.2f}" for c in cols)
              + f" | {r['best_block']} {r['best_block_over_rowwise']}")
    return 1 if "fault" in doc else 0


if __name__ == "__main__":
    sys.exit(main())
