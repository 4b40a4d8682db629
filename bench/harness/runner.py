"""The whole bench harness run: copy bandwidth, qkv_front (all modes + baselines), qk_norm, host costs.

Progress goes to stderr with wall times; the caller prints the table (stdout) and gets the document.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from musekern.store.keys import dist_version

from . import report
from .timing import Stopwatch, copy_bandwidth, log

ALL_M = (1, 2, 4, 8, 9, 12, 16)


@dataclass
class BenchConfig:
    tps: tuple = ()  # empty: every TP of the model plan
    ms: tuple = ALL_M
    modes: tuple = report.FRONT_MODES
    samples: int = 9
    quick: bool = False
    qk_norm: bool = True
    host: bool = True
    all_m: bool = True

    @classmethod
    def make(cls, quick=False, tps=(), ms=(), modes=()):
        """--quick: M 1 and 16, 3 samples, qk_norm at M 16 and 4096 only."""
        return cls(tps=tuple(tps), ms=tuple(ms) or ((1, 16) if quick else ALL_M),
                   modes=tuple(modes) or report.FRONT_MODES, samples=3 if quick else 9, quick=quick)


def _meta(cfg: BenchConfig) -> dict:
    import torch
    from cuda.bindings import driver as drv

    err, drv_ver = drv.cuDriverGetVersion()
    return dict(report.commit_info(), device=torch.cuda.get_device_name(), driver=drv_ver,
                torch=torch.__version__, cuda_bindings=dist_version("cuda-bindings") or dist_version("cuda-python"),
                torch_cuda=torch.version.cuda, modes=list(cfg.modes), samples=cfg.samples,
                layers=8, quick=cfg.quick, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _shards(cfg: BenchConfig):
    from musekern.config import load_config

    from .qkv_front import Shard

    model = load_config()
    plan = {s.tp: s for s in model.shards()}
    tps = cfg.tps or tuple(sorted(plan, reverse=True))
    for tp in tps:
        s = plan.get(tp) or model.shard(tp)
        yield Shard(tp, s.n, s.num_kv_heads, model.rms_norm_eps, model.rope_theta)


def run_qkv_front(cfg: BenchConfig, copy_tbps: float, sw: Stopwatch) -> tuple[list, list]:
    """(rows, pair records): every (N, M) of the plan; a failing pair is recorded, not fatal."""
    import torch

    from .pred import PredKernel
    from .qkv_front import measure_pair

    pred = PredKernel() if "after-norm" in cfg.modes else None
    if pred is not None:
        log(f"{sw} PDL predecessor built with {pred.built_with}")
    rows, pairs = [], []
    for shard in _shards(cfg):
        shard.allocate()
        for m in cfg.ms:
            try:
                pair = measure_pair(shard, m, cfg.modes, pred, copy_tbps, cfg.samples)
            except Exception as e:
                pair = {"N": shard.n, "M": m, "tp": shard.tp, "num_kv_heads": shard.num_kv_heads, "us": {},
                        "error": f"{type(e).__name__}: {e}"}
                torch.cuda.synchronize()  # a sticky CUDA error raises here and ends the run
            pairs.append(pair)
            rows += report.make_rows(pair, copy_tbps, cfg.modes)
            us = " ".join(f"{k}={v:.2f}" for k, v in pair["us"].items() if v is not None)
            log(f"{sw} TP{shard.tp} N={shard.n} M={m}: {us or pair.get('error')}"
                + (f"  ERROR {pair['error']}" if pair.get("error") and us else ""))
        shard.free()
        torch.cuda.empty_cache()
    report.add_m16_checks(rows)
    return rows, pairs


def run_all_m(cfg: BenchConfig, copy_tbps: float, sw: Stopwatch) -> tuple[list, list, str | None]:
    """(rows, cliffs, compile error) of the all-M table (all_m.py): TP 8, 4, 1 at every M of all_m.ALL_M."""
    import torch

    from . import all_m

    compiled, compile_error = all_m._compiled_epilogue()
    rows = []
    for shard in _shards(BenchConfig(tps=all_m.ALL_M_TPS)):
        shard.allocate()
        for m in (all_m.ALL_M if not cfg.quick else (1, 17, 64, 4096)):
            # the epilogue's bandwidth cells: the 2 GiB copy again, right before them (the device drifts over a run)
            here = copy_bandwidth(samples=3) if m >= all_m.TARGETS["epilogue_frac_from_m"] else None
            try:
                got = all_m.measure_all_m(shard, m, copy_tbps, cfg.samples, compiled)
            except Exception as e:
                got = {"us": {}, "path": "-", "error": f"{type(e).__name__}: {e}"}
                torch.cuda.synchronize()  # a sticky CUDA error raises here and ends the run
            r = all_m.row(shard.tp, shard.n, shard.num_kv_heads, m, got["us"], got["path"], copy_tbps, here)
            r.update({k: v for k, v in got.items() if k not in ("us", "path")})
            rows.append(r)
            log(f"{sw} all-M TP{shard.tp} M={m} ({r['path']}): musekern {r['us'].get('musekern')} us, cuBLAS "
                f"{r['us'].get('cublas')} us" + (f"  ERROR {r['error']}" if r.get("error") else ""))
        shard.free()
        torch.cuda.empty_cache()
    return rows, all_m.cliffs(rows, copy_tbps), compile_error


def run_host(cfg: BenchConfig, sw: Stopwatch) -> dict:
    from .host import first_call_subprocess, measure_eager

    shard = next(iter(_shards(BenchConfig(tps=(8,)))))
    host = {}
    try:
        host.update(measure_eager(shard.n, shard.num_kv_heads, 1))
    except Exception as e:
        host["eager_error"] = f"{type(e).__name__}: {e}"
    log(f"{sw} host per call: launch {host.get('launch_us')} us, qkv_front {host.get('qkv_front_us')} us")
    host["first_call"] = first_call_subprocess(shard.n, shard.num_kv_heads, 1)
    log(f"{sw} first call in a fresh process: {host['first_call']}")
    return host


def run(cfg: BenchConfig) -> dict:
    """Everything, in one process, on GPU 0; returns the results document (report.make_doc)."""
    import torch

    sw = Stopwatch()
    torch.cuda.init()
    meta = _meta(cfg)
    log(f"{sw} {meta['device']}, driver {meta['driver']}, torch {meta['torch']}, cuda-bindings "
        f"{meta['cuda_bindings']}, commit {meta['commit']}")
    copy0 = copy_bandwidth()
    log(f"{sw} copy bandwidth (2 GiB d2d, read + write): {copy0:.3f} TB/s")
    rows, pairs = run_qkv_front(cfg, copy0, sw)
    qk = []
    if cfg.qk_norm:
        from . import qk_norm

        try:
            qk = qk_norm.measure(copy0, ms=(16, 4096) if cfg.quick else (16, 4096, 16384), samples=cfg.samples)
        except Exception as e:
            qk = [{"error": f"{type(e).__name__}: {e}", "head_dim": 0, "M": 0, "us": None, "tbps": None,
                   "frac_of_copy_bw": None, "checks": [], "status": "-"}]
        log(f"{sw} qk_norm done")
    host = run_host(cfg, sw) if cfg.host else {}
    if cfg.all_m:
        meta["all_m"], meta["all_m_cliffs"], meta["all_m_compile_error"] = run_all_m(cfg, copy0, sw)
    copy1 = copy_bandwidth()
    log(f"{sw} copy bandwidth at the end: {copy1:.3f} TB/s (fractions use the start value)")
    meta.update(copy_TBps_end=copy1, wall_s=round(time.perf_counter() - sw.t0, 1), pairs=pairs)
    return report.make_doc(meta, copy0, rows, qk, host)
