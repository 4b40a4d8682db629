"""Issue 30's all-M rows: the product call (`ops.qkv_front.launch`: the fused front where a planned build serves M, the
GEMM path above) with e4m3 weights (channel and block scales) beside the same call with bf16 weights, torch.mm
alone (bf16) and torch._scaled_mm alone (x already e4m3, per-token and per-row fp32 scales: cuBLAS's FP8 GEMM), at
every M of the bf16 all-M table (bench/harness/all_m.py's edges) on TP8, TP4 and TP1. 8 layers of weights rotated
past the L2, CUDA-graph replay, round-robin medians, one x for every layer (chain). Writes JSON and the plot
`<out>.png` (us per layer against M, one panel a shard); the table last on stdout, progress on stderr.

Usage (GPU machine, cache carried):
  source bench/device_env.sh && python3 bench/w8_all_m.py --out $OUT/h200-w8-all-m.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.harness import report
from bench.harness.all_m import ALL_M
from bench.harness.plot import plot_us_against_m
from bench.harness.timing import Graph, log, loops_for, time_graphs
from bench.w8_bench import LAYERS, TP_OF, add_op_graphs, add_scaled_mm, layer_inputs
from musekern.config import load_config
from musekern.model import HIDDEN
from musekern.ops import qkv_front as front

SHARDS = ((2176, 1), (4352, 2), (17408, 8))  # TP8, TP4, TP1 (the bf16 all-M table's)
SERIES = (("bf16", "o-", "musekern, bf16 weights"), ("fp8_channel", "s-", "musekern, e4m3 per-channel"),
          ("fp8_block", "^-", "musekern, e4m3 block-128"), ("mm", "x--", "torch.mm alone (bf16)"),
          ("scaled_mm", "d:", "_scaled_mm alone (x pre-quantized)"))


def build(n: int, nkv: int, m: int, eps: float, theta: float, make) -> None:
    """One M's five graphs in order ("bf16", "fp8_channel", "fp8_block": the op after front.prepare of its weight
    format; "mm"; "scaled_mm"), each handed to make(name, LAYERS closures, loops) as soon as it is defined (the
    closures hold the inputs; bench/probes/all_m_replay.py takes them too)."""
    g, cs, pos, x, kc, vc, slots, o, w8, wb = layer_inputs(n, nkv, m, theta, 7000)
    # a replay's GPU work: the weights at ~3 TB/s or the bf16 GEMM at ~600 TFLOP/s, whichever is longer
    loops = loops_for(LAYERS * max(2 * n * HIDDEN / 3e12, 2 * m * n * HIDDEN / 600e12))

    def add(name, call):
        make(name, [(lambda j=j: call(j)) for j in range(LAYERS)], loops)

    add_op_graphs(add, n, nkv, m, g, lambda j: front.launch(x, wb[j], pos, cs, slots, kc, vc, nkv, eps, out=o[j]),
                  lambda j, sc: front.launch(x, w8[j], pos, cs, slots, kc, vc, nkv, eps, out=o[j], weight_scale=sc))
    add("mm", lambda j: torch.mm(x, wb[j].T, out=o[j]))
    add_scaled_mm(add, x, w8, o, g)


def measure(n: int, nkv: int, m: int, eps: float, theta: float, samples: int) -> dict:
    graphs = []
    build(n, nkv, m, eps, theta, lambda name, fs, loops: graphs.append(Graph(name, fs, loops, LAYERS)))
    us = {k: round(v["us"], 3) for k, v in time_graphs(graphs, samples).items()}
    return row(n, m, "front" if front._fused(n, m, 0, "fp8_e4m3") else "gemm", us)


def row(n: int, m: int, path: str, us: dict) -> dict:
    """One M's row: the graphs' us and their ratios."""
    return {"N": n, "tp": TP_OF[n], "M": m, "path": path, "us": us,
            "channel_over_bf16": round(us["fp8_channel"] / us["bf16"], 3),
            "block_over_bf16": round(us["fp8_block"] / us["bf16"], 3),
            "channel_over_scaled_mm": round(us["fp8_channel"] / us["scaled_mm"], 3)}


def table_text(doc: dict) -> str:
    lines = ["TP     M path  | bf16 op | e4m3 ch / blk | mm  | scaled_mm | ch/bf16 blk/bf16 ch/scaled_mm"]
    for r in doc["rows"]:
        u = r["us"]
        lines.append(f"TP{r['tp']} {r['M']:5d} {r['path']:5s} | {u['bf16']:7.1f} | {u['fp8_channel']:6.1f} / "
                     f"{u['fp8_block']:6.1f} | {u['mm']:6.1f} | {u['scaled_mm']:6.1f} | {r['channel_over_bf16']:.3f} "
                     f"{r['block_over_bf16']:.3f} {r['channel_over_scaled_mm']:.3f}")
    return "\n".join(lines)


def write_plot(doc: dict, path: str) -> str | None:
    """One panel a shard: us per layer against M (log-log), each series of SERIES."""
    base, name = path.rsplit("/", 1) if "/" in path else (".", path)
    return plot_us_against_m(doc["rows"], SERIES, f"e4m3 and bf16 weights at every M on {doc['device']} "
                             f"({doc['commit'][:7]})", base, name)


def save(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write (the plot beside it), e.g. $OUT/h200-w8-all-m.json")
    ap.add_argument("--ms", default=",".join(str(m) for m in ALL_M if m <= 4096),
                    help="M values (default: the bf16 all-M table's up to 4096)")
    ap.add_argument("--samples", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("w8_all_m: needs a CUDA GPU; run it on the GPU machine with the cache carried", file=sys.stderr)
        return 2
    model = load_config()
    t0 = time.time()
    doc = dict(report.commit_info(), device=torch.cuda.get_device_name(), torch=torch.__version__,
               time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), layers=LAYERS, samples=a.samples, rows=[])
    for n, nkv in SHARDS:
        for m in (int(s) for s in a.ms.split(",")):
            try:
                r = measure(n, nkv, m, model.rms_norm_eps, model.rope_theta, a.samples)
            except torch.AcceleratorError as e:  # sticky: the process's CUDA context is lost; keep where and what
                doc["fault"] = {"tp": TP_OF[n], "M": m, "error": str(e).splitlines()[0]}
                save(doc, a.out)
                log(f"TP{TP_OF[n]} M={m}: {doc['fault']['error']} (bench/probes/all_m_replay.py locates it)")
                return 1
            doc["rows"].append(r)
            log(f"{time.time() - t0:6.1f}s TP{r['tp']} M={m} {r['path']}: {r['us']}")
            save(doc, a.out)  # after each M: a cut run still leaves its rows
        torch.cuda.empty_cache()
    png = write_plot(doc, a.out.removesuffix(".json") + ".png")
    log(f"wrote {a.out}" + (f" and {png}" if png else ""))
    print(table_text(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
