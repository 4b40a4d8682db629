"""The all-M table of the bench harness (issue 13): every batch size, decode to prefill, per shard.

For each (N, M) the same harness as the decode table (CUDA-graph replay over LAYERS distinct weights, medians,
copy bandwidth of the same run) times, side by side:

- musekern:       the product call, `ops.qkv_front.launch` (the planner's path: the fused front, or cuBLAS's GEMM +
                  the fused epilogue), as an engine launches it (the manifests' PDL attributes);
- front:          the fused front, where a planned build serves this M (`front_serves`);
- gemm_epilogue:  the GEMM path's GEMM (gemm_best) + the fused epilogue, at every M (so that both paths are timed
                  where the rule chooses);
- epilogue:       the fused epilogue alone, on a GEMM result (its bytes: `variants.qkv_epilogue.epilogue_bytes`), one y
                  per layer as the weights are (a y the size of the L2, 60 MB, must not stay there between launches);
- copy:           M >= 1024: torch's device copy of as many bytes (read + written) as the epilogue moves, one buffer
                  pair a layer: the streaming reference at the epilogue's own size, in the same samples (a copy of
                  5-10 MB in a graph reaches ~55-60% of the 2 GiB copy's bandwidth, of 20-40 MB ~70-80%);
Before each M >= 1024 row the runner measures the 2 GiB device copy again (eager, as the run's first one), so the
epilogue's fraction of copy bandwidth also compares two numbers of the same minutes (the H200 streams ~10% slower at
a bench's end than at its start: `copy_TBps`, `copy_TBps_end`). (A 2 GiB copy captured in a graph runs at ~2.7 TB/s,
a different path: not a reference.)
- cublas:         torch.mm alone;  unfused: torch.mm + the plain-torch epilogue (harness/unfused.py);
- gemm_best:      the GEMM path's GEMM alone (`gemm.tune.mm`: the cuBLAS algorithm `gemm.tune.tune` measured fastest for
                  this (N, M) before the graphs, torch.mm unless another was 3% faster; torch.mm untimed above
                  M = 512);
- compiled:       torch.mm + `torch.compile(reference.fused_qknorm_rope_kv_insert, dynamic=True)` (M >= 2).

The row math, targets and table below are pure (tested on the CPU); `measure_all_m` needs the GPU.
"""
from __future__ import annotations

from . import report

# every tile / path edge of the rules, inside cuBLAS's tiles past 64 (72, 100), and prefill
ALL_M = (1, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57, 64, 65, 72, 100, 128, 256, 1024, 4096, 16384)
ALL_M_TPS = (8, 4, 1)  # N = 2176, 4352, 17408
# every 8 tokens from 16 to 65: a superset of where a shard's path or build changes (tests/test_bench_all_m.py)
CLIFF_PAIRS = ((16, 17), (24, 25), (32, 33), (40, 41), (48, 49), (56, 57), (64, 65))
GRAPHS = ("musekern", "front", "gemm_epilogue", "epilogue", "copy", "cublas", "gemm_best", "unfused", "compiled")
TARGETS = {
    "epilogue_min_frac": 0.85, "epilogue_frac_from_m": 1024,  # the epilogue streams its bytes at M >= 1024
    "epilogue_max_us": 2.5, "epilogue_small_m": 64,  # and costs <= 2.5 us at M <= 64
    "gemm_epilogue_max_x_cublas": 1.10, "large_m_from": 1024,  # GEMM + epilogue <= 1.10x the bare GEMM
    "small_m_tps": (8, 4), "small_m_max": 64, "min_x_unfused": 3.0,  # path < cuBLAS and >= 3x cuBLAS + unfused
    "cliff_slack": 0.05,  # a step may cost what its extra bytes cost at copy bandwidth, plus 5%
}


def moved_bytes(n: int, m: int) -> int:
    """The bytes a layer must move at least: the weights, x, y written, the epilogue's cache rows and inputs."""
    return report.weight_bytes(n) + m * report.HIDDEN * 2 + m * n * 2


def row(tp: int, n: int, nkv: int, m: int, us: dict, path: str, copy_tbps: float,
        copy_tbps_here: float | None = None) -> dict:
    """Derived figures and the targets that apply to one (N, M) from its medians (us per layer); `copy_tbps_here`:
    the 2 GiB copy measured right before this row (M >= 1024)."""
    from musekern.kernels.qkv_epilogue.variant import epilogue_bytes

    mus, cub = us.get("musekern"), us.get("cublas")
    epi_bytes = epilogue_bytes(m, n, nkv)
    r = {"tp": tp, "N": n, "M": m, "path": path, "us": us, "bytes": moved_bytes(n, m),
         "epilogue_bytes": epi_bytes, "epilogue_frac_of_copy_bw": _frac(epi_bytes, us.get("epilogue"), copy_tbps),
         "copy_TBps_here": copy_tbps_here,  # the 2 GiB copy timed in the same minutes as this row
         "epilogue_frac_of_copy_bw_here": _frac(epi_bytes, us.get("epilogue"), copy_tbps_here) if copy_tbps_here
         else None,
         "epilogue_frac_of_same_bytes_copy": report.ratio(us.get("copy"), us.get("epilogue")),
         "x_cublas": report.ratio(mus, cub), "x_gemm_best": report.ratio(mus, us.get("gemm_best")),
         "speedup_vs_unfused": report.ratio(us.get("unfused"), mus),
         "speedup_vs_compiled": report.ratio(us.get("compiled"), mus),
         "gemm_epilogue_x_cublas": report.ratio(us.get("gemm_epilogue"), cub)}
    t, checks = TARGETS, []
    if m >= t["epilogue_frac_from_m"]:
        checks.append(report._check("epilogue_frac", r["epilogue_frac_of_copy_bw"], t["epilogue_min_frac"], True))
        if r["epilogue_frac_of_copy_bw_here"] is not None:
            checks.append(report._check("epilogue_frac_here", r["epilogue_frac_of_copy_bw_here"],
                                        t["epilogue_min_frac"], True))
        if r["epilogue_frac_of_same_bytes_copy"] is not None:
            checks.append(report._check("epilogue_frac_same_bytes_copy", r["epilogue_frac_of_same_bytes_copy"],
                                        t["epilogue_min_frac"], True))
        checks.append(report._check("gemm_epilogue_x_cublas", r["gemm_epilogue_x_cublas"],
                                    t["gemm_epilogue_max_x_cublas"], False))
    if m <= t["epilogue_small_m"]:
        checks.append(report._check("epilogue_us", us.get("epilogue"), t["epilogue_max_us"], False))
    if tp in t["small_m_tps"] and m <= t["small_m_max"]:
        checks.append(report._check("x_cublas", r["x_cublas"], 1.0, False))
        checks.append(report._check("vs_unfused", r["speedup_vs_unfused"], t["min_x_unfused"], True))
    r["checks"] = checks
    r["status"] = report.status(checks) if checks else "-"
    return r


def _frac(nbytes: int, us: float | None, copy_tbps: float) -> float | None:
    got = report.tbps(nbytes, us)
    return None if got is None else got / copy_tbps


def cliffs(rows: list[dict], copy_tbps: float) -> list[dict]:
    """For each CLIFF_PAIRS step of each shard: the product call's jump against what its extra bytes explain."""
    by = {(r["N"], r["M"]): r for r in rows}
    out = []
    for n in sorted({r["N"] for r in rows}):
        for a, b in CLIFF_PAIRS:
            ra, rb = by.get((n, a)), by.get((n, b))
            if not ra or not rb or ra["us"].get("musekern") is None or rb["us"].get("musekern") is None:
                continue
            jump = rb["us"]["musekern"] - ra["us"]["musekern"]
            explained = (rb["bytes"] - ra["bytes"]) / (copy_tbps * 1e12) * 1e6
            limit = explained + TARGETS["cliff_slack"] * ra["us"]["musekern"]
            out.append({"tp": ra["tp"], "N": n, "from": a, "to": b, "jump_us": jump, "bytes_explain_us": explained,
                        "paths": [ra["path"], rb["path"]], "pass": jump <= limit})
    return out


def format_all_m(doc: dict) -> str:
    """The all-M table: us per layer of each path, ratios, epilogue bandwidth, PASS/MISS."""
    rows = doc.get("all_m") or []
    if not rows:
        return ""
    hdr = (f"{'tp':>3s} {'M':>6s} {'path':6s} {'musekern':>9s} {'front':>8s} {'mm+epi':>8s} {'epi':>7s} "
           f"{'epiBW':>5s} {'BWnow':>5s} {'vsCpy':>5s} {'cuBLAS':>8s} {'bestGEMM':>8s} {'unfused':>8s} "
           f"{'compiled':>8s} {'xcuBLAS':>7s} {'xunfus':>6s}  status")
    out = ["all M: us per layer (8 distinct layers, graph replay); path = what the planner picks; epiBW = the "
           "fused epilogue's bytes / time / copy BW (2 GiB, the run's start); BWnow = the same against the 2 GiB copy "
           "measured right before the row; vsCpy = a copy of its bytes' time / its time; cuBLAS = torch.mm; bestGEMM = "
           "the cuBLAS algorithm measured fastest (gemm.tune)", hdr,
           "-" * len(hdr)]
    f = report._f
    for r in rows:
        u = r["us"]
        miss = report._misses(r.get("checks", []))
        out.append(f"{r['tp']:>3d} {r['M']:>6d} {r['path']:6s} {f(u.get('musekern'), '9.2f')} "
                   f"{f(u.get('front'), '8.2f')} {f(u.get('gemm_epilogue'), '8.2f')} {f(u.get('epilogue'), '7.2f')} "
                   f"{f(r['epilogue_frac_of_copy_bw'], '5.2f')} {f(r.get('epilogue_frac_of_copy_bw_here'), '5.2f')} "
                   f"{f(r.get('epilogue_frac_of_same_bytes_copy'), '5.2f')} "
                   f"{f(u.get('cublas'), '8.2f')} {f(u.get('gemm_best'), '8.2f')} "
                   f"{f(u.get('unfused'), '8.2f')} {f(u.get('compiled'), '8.2f')} {f(r['x_cublas'], '7.2f')} "
                   f"{f(r['speedup_vs_unfused'], '6.2f')}  {r['status']}" + (f" ({miss})" if miss else "")
                   + (f"  ERROR {r['error'][:60]}" if r.get("error") else ""))
    for c in doc.get("all_m_cliffs") or []:
        out.append(f"step TP{c['tp']} M {c['from']}->{c['to']} ({c['paths'][0]} -> {c['paths'][1]}): "
                   f"{c['jump_us']:+.2f} us, bytes explain {c['bytes_explain_us']:.2f}  "
                   f"{'PASS' if c['pass'] else 'MISS'}")
    return "\n".join(out)


# ---------------------------------------------------------------- the GPU part
BLOCK_SIZE = 16
MAX_POS = 4096


def _compiled_epilogue():
    """torch.compile of the reference epilogue, dynamic in M (None, with the reason, where it cannot build)."""
    import torch

    from musekern.reference import fused_qknorm_rope_kv_insert

    try:
        import torch._dynamo.config as dyn

        dyn.cache_size_limit = max(dyn.cache_size_limit, 64)
        return torch.compile(fused_qknorm_rope_kv_insert, dynamic=True, fullgraph=True), None
    except Exception as e:  # recorded, not fatal
        return None, f"{type(e).__name__}: {e}"


def _problem(n: int, nkv: int, m: int, seed: int) -> dict:
    import torch

    from musekern.reference import rope_cos_sin_table

    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = max(64, -(-m // BLOCK_SIZE) * 2)
    kv = torch.randn(2, blocks, BLOCK_SIZE, nkv, 64, device="cuda", generator=g).to(torch.bfloat16)
    return dict(x=torch.randn(m, report.HIDDEN, device="cuda", generator=g).to(torch.bfloat16),
                positions=torch.randint(0, MAX_POS, (m,), device="cuda", generator=g),
                cos_sin_cache=rope_cos_sin_table(MAX_POS, 1e6, "cuda"),
                slot_mapping=torch.randperm(blocks * BLOCK_SIZE, device="cuda", generator=g)[:m],
                key_cache=kv[0], value_cache=kv[1])


def measure_all_m(shard, m: int, copy_tbps: float, samples: int, compiled) -> dict:
    """Graphs of every applicable GRAPHS entry for one (N, M), an output check, the medians."""
    import torch

    from musekern.gemm import tune as gemm
    from musekern.kernels.qkv_epilogue.variant import epilogue_bytes
    from musekern.ops import qkv_epilogue as epi
    from musekern.ops import qkv_front as ops

    from .timing import Graph, copy_closures, loops_for, time_graphs
    from .unfused import unfused_epilogue

    n, nkv, eps, W = shard.n, shard.num_kv_heads, shard.eps, shard.weights
    p = _problem(n, nkv, m, seed=7 + m)
    tok = (p["positions"], p["cos_sin_cache"], p["slot_mapping"], p["key_cache"], p["value_cache"])
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    dev = torch.cuda.current_device()
    fused = ops._fused(n, m, dev)
    choice = gemm.tune(n, [m], dev)[0]  # what `prepare` does for the GEMM path (here for every M: gemm_best)
    ys = [torch.empty_like(y) for _ in W]  # the epilogue's own inputs, one a layer (filled below, after the check)
    seq = {"musekern": [lambda w=w: ops.launch(p["x"], w, *tok, nkv, eps, y) for w in W],
           "gemm_epilogue": [lambda w=w: ops.launch_gemm_epilogue(p["x"], w, *tok, nkv, eps, y) for w in W],
           "epilogue": [lambda y_=y_: epi.launch(y_, *tok, nkv, eps) for y_ in ys],
           "cublas": [lambda w=w: torch.mm(p["x"], w.t(), out=y) for w in W],
           "gemm_best": [lambda w=w: gemm.mm(p["x"], w, y) for w in W],
           "unfused": [lambda w=w: unfused_epilogue(torch.mm(p["x"], w.t()), *tok, nkv, eps) for w in W]}
    if m >= TARGETS["epilogue_frac_from_m"]:
        seq["copy"] = copy_closures(epilogue_bytes(m, n, nkv), len(W))
    if fused:
        seq["front"] = [lambda w=w: ops.launch_front(p["x"], w, *tok, nkv, eps, y) for w in W]
    if compiled is not None and m >= 2:
        seq["compiled"] = [lambda w=w: compiled(torch.mm(p["x"], w.t()), *tok, nkv, eps) for w in W]
    # the product call against the plain-torch epilogue on the same GEMM, before any timing (y poisoned first)
    y.fill_(float("nan"))
    ops.launch(p["x"], W[0], *tok, nkv, eps, y)
    want = unfused_epilogue(torch.mm(p["x"], W[0].t()), *tok, nkv, eps)
    err = ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()
    for i, y_ in enumerate(ys):  # each layer's GEMM result
        torch.mm(p["x"], W[i].t(), out=y_)
    loops = loops_for(len(W) * report.floor_us(n, copy_tbps) * 1e-6 * max(1.0, m / 256))
    graphs = [Graph(name, closures, loops, len(W)) for name, closures in seq.items()]
    timed = time_graphs(graphs, samples)
    del graphs
    out = {"us": {k: t["us"] for k, t in timed.items()}, "samples": {k: t["samples"] for k, t in timed.items()},
           "path": "front" if fused else "gemm", "max_rel_err_vs_unfused": err, "gemm_choice": choice.chosen}
    if not err <= 2.0 ** -6:  # NaN (an unwritten y) fails too
        out["error"] = f"output check: max |y - unfused| / max |unfused| = {err:.3g}"
    return out
