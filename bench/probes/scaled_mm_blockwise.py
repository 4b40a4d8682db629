"""Probe (issue 30, the block GEMM path): does this torch's torch._scaled_mm serve block-scaled FP8 on sm_90, in
which forms, how exact and how fast next to the row-wise form?

Forms tried (torch's meta rules, _meta_registrations.py `_check_scaled_mm_sizes`): x always 1x128 (scale_a [M, K/128],
column-major), the weight either 1x128 per row (scale_b [K/128, N]: any row granularity, so musekern's 64-row block
scales expand to it exactly) or 128x128 (scale_b [K/128, N/128]). Exactness: against fp64 of dequant(x) @ dequant(W)^T;
the bound is the row-wise form's own error on the same bytes. Timing: 8 layers of weights rotated past the L2,
CUDA-graph replay, medians (bench/harness/timing.py).

Usage (GPU machine; one process a form, so that a form that kills its process leaves the others' rows):
  source bench/device_env.sh && for f in row 1x128_1x128 v2_1x128_1x128 1x128_128x128; do
    python3 -X faulthandler bench/probes/scaled_mm_blockwise.py $f; done
"""
from __future__ import annotations

import json
import sys

import torch

from bench.harness.timing import Graph, loops_for, time_graphs

K, LAYERS = 8192, 8
E4 = torch.float8_e4m3fn


def quant_groups(x: torch.Tensor):
    """x bf16 [M, K] -> (e4m3 [M, K], fp32 scales [M, K/128] column-major): s = max(amax / 448, tiny) per group."""
    m = x.shape[0]
    g = x.float().view(m, K // 128, 128)
    s = (g.abs().amax(-1) / 448.0).clamp_min(1.0 / (448 * 512))
    q = (g / s[..., None]).clamp(-448, 448).to(E4).view(m, K)
    return q, s.t().contiguous().t()


def v2(qx, w, sx, sb, recipe_b):
    """torch.nn.functional.scaled_mm (the recipe API, where this torch has it)."""
    import torch.nn.functional as F
    st = F.ScalingType
    return F.scaled_mm(qx, w.t(), sx, st.BlockWise1x128, sb, getattr(st, recipe_b), output_dtype=torch.bfloat16)


def forms(m: int, n: int, g):
    x = torch.randn(m, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, K, device="cuda", generator=g) * 0.5).to(E4)
    sb64 = torch.exp2(torch.empty(n // 64, K // 128, device="cuda").uniform_(-8, -4, generator=g))
    qx, sx = quant_groups(x)
    row_sx = (x.float().abs().amax(-1, keepdim=True) / 448.0).clamp_min(1.0 / (448 * 512))
    qx_row = (x.float() / row_sx).clamp(-448, 448).to(E4)
    sw_row = torch.exp2(torch.empty(1, n, device="cuda").uniform_(-8, -4, generator=g))
    sb_rows = sb64.repeat_interleave(64, 0)  # [N, K/128]: the 64-row scales per row
    sb_cm = sb_rows.t().contiguous()  # [K/128, N] row-major = [N, K/128] with strides (1, N)
    sb128 = sb64[::2].contiguous()  # [N/128, K/128] (pairs forced equal below)

    def ref(sx_, qx_, sw_rows):  # fp64 of dequant(x) @ dequant(W)^T, computed only when asked
        def f():
            xd = (qx_.double().view(m, -1, 128 if sx_.shape[1] > 1 else K) * sx_.double()[..., None]).view(m, K)
            wd = (w.double().view(n, -1, 128 if sw_rows.shape[1] > 1 else K) * sw_rows.double()[..., None]).view(n, K)
            return xd @ wd.t()
        return f
    return {
        "row": (lambda: torch._scaled_mm(qx_row, w.t(), scale_a=row_sx, scale_b=sw_row, out_dtype=torch.bfloat16),
                ref(row_sx, qx_row, sw_row.t())),
        "1x128_1x128": (lambda: torch._scaled_mm(qx, w.t(), scale_a=sx, scale_b=sb_cm, out_dtype=torch.bfloat16),
                        ref(sx, qx, sb_rows)),
        "v2_1x128_1x128": (lambda: v2(qx, w, sx, sb_cm.t(), "BlockWise1x128"), ref(sx, qx, sb_rows)),
        "1x128_128x128": (lambda: torch._scaled_mm(qx, w.t(), scale_a=sx, scale_b=sb128.t(), out_dtype=torch.bfloat16),
                          ref(sx, qx, sb128.repeat_interleave(128, 0))),
    }


def main() -> int:
    g = torch.Generator(device="cuda").manual_seed(1)
    print(f"torch {torch.__version__} cuda {torch.version.cuda} {torch.cuda.get_device_name()}", file=sys.stderr)
    only = sys.argv[1]
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "form": only, "rows": []}
    for n in (2176, 17408):
        for m in (32, 64, 256, 1024, 8192):
            row = {"N": n, "M": m, "err": {}, "ok": {}, "us": {}}
            fs = forms(m, n, g)
            runnable = {}
            for name, (call, want) in fs.items():
                if name != only:
                    continue
                print(f"{name} N={n} M={m}", file=sys.stderr, flush=True)
                try:
                    y = call()
                    torch.cuda.synchronize()
                    if m <= 256:
                        w_ = want()
                        row["err"][name] = round((y.double() - w_).abs().max().item() / w_.abs().max().item(), 6)
                        del w_
                    runnable[name] = call
                except Exception as ex:  # the form is not served: say which error
                    row["ok"][name] = f"{type(ex).__name__}: {str(ex)[:160]}"
            # timing: LAYERS copies of each runnable form (fresh weights each layer: rotated past the L2)
            graphs = []
            for name in runnable:
                calls = [forms(m, n, g)[name][0] for _ in range(LAYERS)]
                graphs.append(Graph(name, calls, loops_for(2 * m * n * K / 600e12 * LAYERS), LAYERS))
            t = time_graphs(graphs, 7)
            row["us"] = {k: round(v["us"], 2) for k, v in t.items()}
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    for r in out["rows"]:
        print(f"{only} N={r['N']} M={r['M']} err {r['err'].get(only)} us {r['us'].get(only)} {r['ok'] or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
