"""Pure row math, targets, the JSON document and the stdout table of the bench harness (no GPU, no torch).

Everything the GPU part measures arrives here as plain numbers (us per layer), so every derived figure
(floor, fraction of copy bandwidth, speedups, PASS/MISS) is computed - and tested - on the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess

from musekern.model import HIDDEN  # K of the projection: weight bytes per layer = N * HIDDEN * 2

BF16_BYTES = 2
FRONT_MODES = ("chain", "after-norm", "isolated")

# The targets of issue 5, in one place. Fractions are of the copy bandwidth measured in the same run
# (weight bytes / time / copy bytes-per-second, read + written); times are us per layer.
TARGETS = {
    "qkv_front": {
        "tp8": {"chain_frac": 0.90, "added_us": 9.0, "isolated_frac": 0.72, "vs_cublas": 1.5, "vs_unfused": 4.0},
        "tp4": {"chain_frac": 0.95, "added_us": 17.5, "isolated_frac": 0.86, "vs_cublas": 1.35, "vs_unfused": 2.5},
        "tp2": {"chain_frac": 0.97, "added_floor_x": 1.0, "isolated_frac": 0.90, "vs_cublas": 1.2,
                "vs_unfused": 1.5},
        "tp1": {"chain_frac": 0.97, "added_floor_x": 1.0, "isolated_frac": 0.90, "vs_cublas": 1.04,
                "vs_unfused": 1.5},
    },
    "m16_vs_m1_max_ratio": 1.10,  # M = 16 within 10% of M = 1 (same N and mode)
    "qk_norm": {"min_frac": 0.80, "large_m_from": 4096, "m16_max_us": 1.6},
    "host": {"launch_max_us": 10.0, "qkv_front_max_us": 20.0, "first_call_max_ms": 50.0},
}


# ---------------------------------------------------------------- row math
def weight_bytes(n: int) -> int:
    return n * HIDDEN * BF16_BYTES


def floor_us(n: int, copy_tbps: float) -> float:
    """The time to stream one layer's weights at copy bandwidth: no front can beat it by much."""
    return weight_bytes(n) / (copy_tbps * 1e12) * 1e6


def tbps(nbytes: float, us: float | None) -> float | None:
    return None if not us or us <= 0 else nbytes / (us * 1e-6) / 1e12


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing (a failed measurement never becomes a fake number)."""
    return None if a is None or b is None or b <= 0 else a / b


def _check(name: str, value, target, higher_is_better: bool) -> dict:
    ok = None if value is None else (value >= target if higher_is_better else value <= target)
    return {"name": name, "value": value, "target": target, "pass": ok}


def front_checks(mode: str, tp: int, us: float, frac: float | None, floor: float, vs_cublas, vs_unfused) -> list:
    """The issue-5 targets that apply to one front row (a TP outside the model plan has none)."""
    t = TARGETS["qkv_front"].get(f"tp{tp}")
    if t is None:
        return []
    if mode == "chain":
        return [_check("frac_of_copy_bw", frac, t["chain_frac"], True),
                _check("speedup_vs_cublas", vs_cublas, t["vs_cublas"], True),
                _check("speedup_vs_unfused", vs_unfused, t["vs_unfused"], True)]
    if mode == "after-norm":
        limit = t["added_us"] if "added_us" in t else t["added_floor_x"] * floor
        return [_check("added_us", us, limit, False)]
    if mode == "isolated":
        return [_check("frac_of_copy_bw", frac, t["isolated_frac"], True)]
    return []


def status(checks: list) -> str:
    """PASS when every check passed, MISS when one missed, '-' when nothing was checked or measured."""
    vals = [c["pass"] for c in checks if c["pass"] is not None]
    if not vals:
        return "-"
    return "PASS" if all(vals) else "MISS"


def make_rows(pair: dict, copy_tbps: float, modes=FRONT_MODES) -> list[dict]:
    """One row per mode (plus cublas/unfused baseline rows) from one (N, M) measurement.

    `pair`: {"N", "M", "tp", "num_kv_heads", "us": {"chain", "after_norm_total", "pred_only", "isolated",
    "cublas", "unfused"} (any may be None or absent), optional "error", "checks_ok"}. In after-norm
    mode `us` is the front's added time (per-layer total minus the predecessor-only chain).
    """
    n, m, tp = pair["N"], pair["M"], pair["tp"]
    u = pair.get("us", {})
    fl = floor_us(n, copy_tbps)
    wb = weight_bytes(n)
    cub, unf = u.get("cublas"), u.get("unfused")
    rows = []
    base = {"N": n, "M": m, "tp": tp, "num_kv_heads": pair.get("num_kv_heads"), "floor_us": fl,
            "cublas_us": cub, "unfused_us": unf}
    for mode in modes:
        extra = {}
        if mode == "after-norm":
            tot, pred = u.get("after_norm_total"), u.get("pred_only")
            us = None if tot is None or pred is None else tot - pred
            extra = {"total_us": tot, "pred_us": pred}
        else:
            us = u.get(mode)
        frac = ratio(fl, us)
        vc, vu = ratio(cub, us), ratio(unf, us)
        checks = front_checks(mode, tp, us, frac, fl, vc, vu) if us is not None else []
        row = dict(base, mode=mode, us=us, tbps=tbps(wb, us), frac_of_copy_bw=frac, speedup_vs_cublas=vc,
                   speedup_vs_unfused=vu, **extra, checks=checks)
        if pair.get("error"):
            row["error"] = pair["error"]
        if mode in pair.get("output_checks", {}):
            row["output_check"] = pair["output_checks"][mode]
        rows.append(row)
    for mode, us in (("cublas", cub), ("unfused", unf)):
        if us is not None:
            rows.append(dict(base, mode=mode, us=us, tbps=tbps(wb, us), frac_of_copy_bw=ratio(fl, us),
                             speedup_vs_cublas=None, speedup_vs_unfused=None, checks=[]))
    return rows


def add_m16_checks(rows: list[dict]) -> None:
    """M = 16 within 10% of M = 1 for the same N and mode: appended to the M = 16 row's checks."""
    limit = TARGETS["m16_vs_m1_max_ratio"]
    m1 = {(r["N"], r["mode"]): r["us"] for r in rows if r["M"] == 1 and r["mode"] in FRONT_MODES}
    for r in rows:
        if r["M"] == 16 and r["mode"] in FRONT_MODES and (r["N"], r["mode"]) in m1:
            r["checks"].append(_check("m16_over_m1", ratio(r["us"], m1[(r["N"], r["mode"])]), limit, False))
    for r in rows:
        r["status"] = status(r["checks"])
        if (r.get("output_check") or {}).get("ok") is False:
            r["status"] = "FAIL"  # wrong outputs: the time means nothing


def qk_norm_row(head_dim: int, m: int, width: int, us: float | None, copy_tbps: float, esize: int = 2) -> dict:
    """qk_norm moves M x width elements in and out: fraction of copy bandwidth (read + write bytes)."""
    q = TARGETS["qk_norm"]
    nbytes = 2 * m * width * esize
    bw = tbps(nbytes, us)
    frac = ratio(bw, copy_tbps)
    checks = []
    if m >= q["large_m_from"]:
        checks.append(_check("frac_of_copy_bw", frac, q["min_frac"], True))
    if m == 16:
        checks.append(_check("us", us, q["m16_max_us"], False))
    return {"head_dim": head_dim, "M": m, "width": width, "bytes": nbytes, "us": us, "tbps": bw,
            "frac_of_copy_bw": frac, "checks": checks, "status": status(checks)}


def host_checks(host: dict) -> dict:
    """PASS/MISS of the host-side targets, from the measured host dict (missing entries stay '-')."""
    t = TARGETS["host"]
    checks = [_check("launch_us", host.get("launch_us"), t["launch_max_us"], False),
              _check("qkv_front_us", host.get("qkv_front_us"), t["qkv_front_max_us"], False),
              _check("first_call_ms", (host.get("first_call") or {}).get("first_call_ms"),
                     t["first_call_max_ms"], False)]
    return {"checks": checks, "status": status(checks)}


# ---------------------------------------------------------------- the JSON document
def commit_info(root: str = ".", cache_dir: str | None = None) -> dict:
    """The commit the cubins were built from (BUILD_INFO.json of the cache), else `git rev-parse HEAD`."""
    cache_dir = cache_dir or os.environ.get("MUSEKERN_CACHE_DIR") or os.path.join(root, ".musekern-cache")
    p = os.path.join(cache_dir, "BUILD_INFO.json")
    try:
        with open(p) as f:
            info = json.load(f)
        if info.get("commit"):
            return {"commit": info["commit"], "dirty": info.get("dirty"), "commit_source": p}
    except (OSError, ValueError):
        pass
    rev = git_state(root)["commit"]
    return {"commit": rev, "dirty": None, "commit_source": "git" if rev else None}


def git_state(root: str = ".") -> dict:
    """{"commit": HEAD or None, "dirty": tracked files modified}: what a build made from this tree records
    (bench/gpu_cache.sh's BUILD_INFO.json, the probes' manifests)."""
    def git(*args) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    rev = git("rev-parse", "HEAD")
    return {"commit": rev or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if rev else None}


DOC_KEYS = ("commit", "device", "driver", "torch", "cuda_bindings", "copy_TBps", "rows", "qk_norm", "host",
            "targets")


def make_doc(meta: dict, copy_tbps: float, rows: list, qk_rows: list, host: dict) -> dict:
    """The results document: DOC_KEYS first (the schema the tests pin), then the rest of `meta`."""
    doc = {"commit": meta.get("commit"), "device": meta.get("device"), "driver": meta.get("driver"),
           "torch": meta.get("torch"), "cuda_bindings": meta.get("cuda_bindings"), "copy_TBps": copy_tbps,
           "rows": rows, "qk_norm": qk_rows, "host": dict(host, **host_checks(host)), "targets": TARGETS}
    for k, v in meta.items():
        doc.setdefault(k, v)
    return doc


def write_json(doc: dict, out_dir: str, name: str = "qkv_front_bench.json") -> str:
    os.makedirs(out_dir, exist_ok=True)
    p = os.path.join(out_dir, name)
    tmp = p + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, p)
    return p


# ---------------------------------------------------------------- the table
def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _misses(checks: list) -> str:
    return ",".join(c["name"] for c in checks if c["pass"] is False)


def format_table(doc: dict) -> str:
    """The short stdout table: one line per (N, M, mode), then qk_norm and host lines, with PASS/MISS."""
    out = [f"qkv_front on {doc.get('device')} (driver {doc.get('driver')}, torch {doc.get('torch')}, commit "
           f"{str(doc.get('commit'))[:12]}); copy {_f(doc.get('copy_TBps'), '.3f')} TB/s; us per layer, "
           f"frac = weight bytes / time / copy BW; after-norm us = front's added time"]
    hdr = (f"{'tp':>3s} {'N':>6s} {'M':>3s} {'mode':10s} {'us':>8s} {'floor':>7s} {'frac':>6s} {'TB/s':>6s} "
           f"{'xcuBLAS':>7s} {'xunfus':>7s}  status")
    out += [hdr, "-" * len(hdr)]
    for r in doc["rows"]:
        st = r.get("status", "-")
        miss = _misses(r.get("checks", []))
        if r.get("error") and r["us"] is None:
            st = "ERROR " + r["error"][:60]
        out.append(f"{r['tp']:>3d} {r['N']:>6d} {r['M']:>3d} {r['mode']:10s} {_f(r['us'], '8.2f')} "
                   f"{r['floor_us']:7.2f} {_f(r['frac_of_copy_bw'], '6.3f')} {_f(r['tbps'], '6.2f')} "
                   f"{_f(r['speedup_vs_cublas'], '7.2f')} {_f(r['speedup_vs_unfused'], '7.2f')}  {st}"
                   + (f" ({miss})" if miss else ""))
    if doc.get("qk_norm"):
        out.append("qk_norm (M >= 4096: strided rows of 8192 columns; M = 16: the seed's [16, 4096]; "
                   "frac = bytes read + written / time / copy BW):")
        for q in doc["qk_norm"]:
            miss = _misses(q.get("checks", []))
            floor = f" (empty-kernel launch floor {q['launch_floor_us']:.2f} us)" if q.get("launch_floor_us") else ""
            out.append(f"  head_dim {q['head_dim']:>3d} M {q['M']:>6d}: {_f(q['us'], '9.2f')} us "
                       f"{_f(q['tbps'], '6.2f')} TB/s frac {_f(q['frac_of_copy_bw'], '.3f')}  {q['status']}"
                       + (f" ({miss})" if miss else "") + floor)
    h = doc.get("host") or {}
    if h:
        fc = h.get("first_call") or {}
        out.append(f"host: launch {_f(h.get('launch_us'), '.2f')} us/call, qkv_front (checked) "
                   f"{_f(h.get('qkv_front_us'), '.2f')} us/call, first call in a fresh process "
                   f"{_f(fc.get('first_call_ms'), '.1f')} ms (torch/CUDA init {_f(fc.get('cuda_init_ms'), '.0f')} ms, "
                   f"import musekern {_f(fc.get('import_ms'), '.0f')} ms)  {h.get('status', '-')}"
                   + (f" ({_misses(h.get('checks', []))})" if _misses(h.get("checks", [])) else ""))
    n_rows = [r for r in doc["rows"] if r.get("status") in ("PASS", "MISS", "FAIL")]
    n_pass = sum(r["status"] == "PASS" for r in n_rows)
    n_fail = sum(r["status"] == "FAIL" for r in n_rows)
    out.append(f"summary: {n_pass}/{len(n_rows)} checked rows PASS, {len(n_rows) - n_pass - n_fail} MISS"
               + (f", {n_fail} FAIL (output check)" if n_fail else ""))
    return "\n".join(out)
