#!/usr/bin/env python3
"""The fused front above M = 16 (issue 13, item 2), in one device call: the GPU tests of the new builds, then
the front against cuBLAS's bare GEMM at M in TIMED_MS for TP8, TP4, TP2 and TP1 (M above FRONT_MAX_TOKENS: no
front build, cuBLAS and the unfused chain only).

Here (CPU, build extra):     bash bench/gpu_cache.sh      (builds, among the rest, every label `labels` prints)
                             python bench/front_large_m.py labels
There (GPU, cache carried):  python3 bench/front_large_m.py run OUT.json [--no-tests]

Timing is the bench harness's (bench/harness/qkv_front.py::measure_pair: CUDA-graph replay over 8 layers of
distinct weights, medians, the chain with PDL and the isolated launches through the product path, cuBLAS's
bare GEMM and the unfused torch chain in the same graphs' round robin, every front layer checked bitwise
against an eager launch); the alternatives beside the plan (tests/qkv_front_builds.py::front_candidates) are
timed by bench/sweep_variants.py::run. In the table, "beats" says whether the front's isolated launch (no PDL, as
cuBLAS) beats the bare GEMM at that (N, M); "path" is what the planner picks (musekern.variants.front_serves):
the front, or cuBLAS + the fused epilogue.
"""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]

SAMPLES = 5
MODES = ("chain", "isolated")


def labels() -> list:
    """Every qkv_front build the run launches that the default plan (M <= 16) does not hold."""
    from qkv_front_builds import front_builds, front_candidates, gpu_test_builds

    from musekern.targets import get_target

    t = get_target("h200")
    planned = front_builds(t)
    out = [v.label for v in planned + gpu_test_builds(planned)] + [v.label for _, v, _ in front_candidates(t)]
    return list(dict.fromkeys(out))


def run_tests(out_dir: str) -> dict:
    """tests/test_gpu_qkv_front.py's above-16 tests; the junit XML summarised by bench/gpu_results.py."""
    xml, js = os.path.join(out_dir, "front-tests.junit.xml"), os.path.join(out_dir, "front-tests.json")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-k",
                        "above_16", "-o", "junit_family=xunit1", "--junitxml", xml, "tests/test_gpu_qkv_front.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    print("\n".join(r.stdout.strip().splitlines()[-6:]), file=sys.stderr)
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_results.py"), xml, js], cwd=ROOT,
                   capture_output=True, text=True)
    try:
        with open(js) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {}
    return {"rc": r.returncode, "wall_s": round(time.perf_counter() - t0, 1), "tail": r.stdout[-1500:],
            **{k: doc.get(k) for k in ("summary", "tests") if k in doc}}


def variant_fields(v) -> dict:
    return {"label": v.label, "tiles": v.tiles, "k_split": v.k_split, "stages": v.stages, "trigger": v.trigger,
            "trigger_ahead": v.trigger_ahead, "warp_split": v.warp_split}


def time_front(samples: int = SAMPLES) -> tuple[list, list, float]:
    """(rows of the planned front + baselines per (N, M), rows of the alternatives, copy TB/s)."""
    import torch
    from qkv_front_builds import TIMED_MS, front_candidates, shards
    from sweep_variants import run as time_variant

    from bench.harness.qkv_front import Shard, measure_pair
    from bench.harness.report import floor_us
    from bench.harness.timing import copy_bandwidth
    from musekern.config import load_config
    from musekern.kernels.qkv_front.rules import front_serves
    from musekern.kernels.qkv_front.variant import FRONT_MAX_TOKENS
    from musekern.ops.qkv_front import _variant
    from musekern.targets import get_target

    model = load_config()
    bw = copy_bandwidth()
    print(f"copy {bw:.3f} TB/s", file=sys.stderr)
    cands = front_candidates(get_target("h200"))
    rows, alt_rows = [], []
    for tp, n, nkv in shards():
        shard = Shard(tp, n, nkv, model.rms_norm_eps, model.rope_theta)
        shard.allocate()
        for m in TIMED_MS:
            has_front = m <= FRONT_MAX_TOKENS
            try:
                pair = measure_pair(shard, m, MODES if has_front else (), None, bw, samples)
            except Exception as e:  # a missing build: recorded, the run goes on
                pair = {"us": {}, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            us = pair["us"]
            fields = variant_fields(_variant(n, m, nkv, torch.cuda.current_device())) if has_front else {}
            row = {"tp": tp, "N": n, "M": m, **fields, "floor_us": round(floor_us(n, bw), 3),
                   "path": "front" if front_serves(n, m, get_target("h200")) else "cublas+epilogue",
                   **{f"{k}_us": round(x, 3) for k, x in us.items() if x is not None}}
            checks = pair.get("output_checks")
            row["output_checks_ok"] = all(r["ok"] for r in checks.values()) if checks else None
            if "error" in pair:
                row["error"] = pair["error"]
            if "isolated" in us and "cublas" in us:
                row["front_beats_cublas"] = us["isolated"] < us["cublas"]
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("tp", "M", "chain_us", "isolated_us", "cublas_us")}),
                  file=sys.stderr)
        for name, v, m in cands:
            if v.n != n:
                continue
            r = time_variant(v, m, shard.weights, bw, None)
            alt_rows.append({"name": name, "tp": tp, "M": m, **variant_fields(v),
                             **{k: r[k] for k in ("chain_us", "isolated_us", "blocks_per_sm") if k in r}})
            print(json.dumps(alt_rows[-1]), file=sys.stderr)
        shard.free()
        torch.cuda.empty_cache()
    return rows, alt_rows, bw


def table(rows: list, alt_rows: list) -> None:
    cublas = {(r["tp"], r["M"]): r.get("cublas_us") for r in rows}
    print("alternatives (us; vs the plan's row at the same M)")
    for a in alt_rows:
        print(f"  {a['name']:18} S={a['k_split']} st={a['stages']:2} {a['trigger']:5} {a['warp_split']:4} "
              f"chain {a.get('chain_us', '-'):>7} isolated {a.get('isolated_us', '-'):>7} "
              f"cuBLAS {cublas.get((a['tp'], a['M'])) or '-':>7}")
    print(f"{'TP':>3} {'N':>5} {'M':>3} {'tiles':>5} {'S':>2} {'st':>2} {'trig':5} {'warps':5} {'floor':>6} "
          f"{'chain':>7} {'isol':>7} {'cuBLAS':>7} {'unfused':>7} {'isol/cuBLAS':>11} {'beats':5} path")
    for r in rows:
        if "error" in r:
            print(f"{r['tp']:3} {r['N']:5} {r['M']:3} ERROR {r['error'][:90]}")
            continue
        if "isolated_us" not in r:  # no front build for this M
            print(f"{r['tp']:3} {r['N']:5} {r['M']:3} {'-':>5} {'':2} {'':2} {'':5} {'':5} {r['floor_us']:6.2f} "
                  f"{'-':>7} {'-':>7} {r['cublas_us']:7.2f} {r.get('unfused_us', 0):7.2f} {'-':>11} {'-':5} "
                  f"{r['path']}")
            continue
        ratio = r["isolated_us"] / r["cublas_us"]
        print(f"{r['tp']:3} {r['N']:5} {r['M']:3} {r['tiles']:5} {r['k_split']:2} {r['stages']:2} {r['trigger']:5} "
              f"{r['warp_split']:5} {r['floor_us']:6.2f} {r['chain_us']:7.2f} {r['isolated_us']:7.2f} "
              f"{r['cublas_us']:7.2f} {r.get('unfused_us', 0):7.2f} {ratio:11.3f} "
              f"{'yes' if r['front_beats_cublas'] else 'NO':5} {r['path']}")


def run(out_json: str, tests: bool = True) -> int:
    import torch

    from bench.harness.report import commit_info

    t0 = time.perf_counter()
    out_dir = os.path.dirname(os.path.abspath(out_json))
    test_res = run_tests(out_dir) if tests else None
    rows, alt_rows, bw = time_front()
    doc = {**commit_info(ROOT), "device": torch.cuda.get_device_name(),
           "command": "python3 bench/front_large_m.py run " + " ".join(sys.argv[2:]), "copy_TBps": round(bw, 3),
           "samples": SAMPLES, "layers": 8, "rows": rows, "alternatives": alt_rows, "tests": test_res,
           "wall_s": round(time.perf_counter() - t0, 1)}
    with open(out_json, "w") as f:
        json.dump(doc, f, indent=1)
    if test_res:
        print(f"tests: rc={test_res['rc']} {test_res.get('summary')} ({test_res['wall_s']} s)")
    table(rows, alt_rows)
    return 0 if (test_res is None or test_res["rc"] == 0) and not any("error" in r for r in rows) else 1


def main(argv) -> int:
    if argv[:1] == ["labels"]:
        print("\n".join(labels()))
        return 0
    if argv[:1] == ["run"] and len(argv) >= 2:
        return run(argv[1], tests="--no-tests" not in argv)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
