"""`musekern doctor`: what is installed, which GPU and driver, which cache, every MUSEKERN_* variable
(value and source), and every planned variant the cache still misses."""
from __future__ import annotations

import platform
import shlex

import click

from .. import __version__
from ..plan import plan_model
from ..store.keys import dist_version
from .common import (
    cache_dir_option,
    emit_json,
    environment,
    json_option,
    log,
    plan_options,
    table,
    wide_option,
)


def _gpus() -> tuple[list[dict], str | None]:
    try:
        from ..targets import _driver_devices

        devs = _driver_devices()
    except Exception as e:  # a broken driver install is a finding, not a crash
        return [], f"{type(e).__name__}: {e}"
    out = []
    for name, cap, sms, smem, l2 in devs:
        from ..targets import arch_for_capability, target_from_device

        out.append({"name": name, "capability": f"{cap[0]}.{cap[1]}", "arch": arch_for_capability(*cap),
                    "sm_count": sms, "target": target_from_device(name, cap, sms, smem, l2).name})
    return out, None


def _driver_version() -> int | None:
    try:
        from cuda.bindings import driver as drv

        err, v = drv.cuDriverGetVersion()
        return v if err == drv.CUresult.CUDA_SUCCESS else None
    except Exception:  # no libcuda: no driver on this machine
        return None


def bindings_driver_problem(bindings: str | None, driver: int | None) -> str | None:
    """Why this cuda-bindings cannot drive this driver, or None. cuda-bindings N.x needs a driver of CUDA N
    (12.x: R525.60.13 or later; 13.x: R580.65.06 or later, cuda-python's install notes); cuDriverGetVersion
    gives the driver's CUDA version as 1000 * major + 10 * minor."""
    if not bindings or not driver:
        return None
    try:
        major = int(bindings.split(".")[0])
    except ValueError:
        return None
    if driver // 1000 >= major:
        return None
    fix = ("pip install 'cuda-bindings>=12.8,<13'  (or musekern[cu12]), or update the driver to R580+"
           if major >= 13 else "update the driver to R525.60.13 or later")
    return (f"cuda-bindings {bindings} needs a driver for CUDA {major}.x; this driver supports CUDA "
            f"{driver // 1000}.{driver % 1000 // 10}: {fix}")


def _remote_problem() -> str | None:
    """Why `prepare` would refuse the remote's settings (MUSEKERN_REMOTE, its token, timeout and budget), or
    None. The remote is not contacted; no credential is shown (RemoteError masks them)."""
    from ..store.remote import RemoteCache, RemoteError

    try:
        RemoteCache.from_env(None)
    except RemoteError as e:
        return f"remote cache: {e}"
    return None


def _fix_command(plan, cache_dir, missing) -> str:
    """The one `musekern prepare` that builds every missing variant (same model, TP sizes, formats, cache)."""
    return (f"musekern prepare{plan.flags(targets=list(dict.fromkeys(m['target'] for m in missing)))}"
            + (f" --cache-dir {shlex.quote(cache_dir)}" if cache_dir else ""))


@click.command("doctor")
@plan_options
@cache_dir_option
@wide_option
@json_option
def doctor_cmd(plan, cache_dir, as_json):
    """Report versions, GPU and driver, the cache, MUSEKERN_* variables, and the model's variants missing
    from the cache (exit 1 if any, or if cuda-bindings cannot drive this driver)."""
    from ..gemm import records
    from ..store import lookup
    from ..store.cache import Cache, default_cache_dir
    from ..store.keys import key_parts

    model, targets = plan.load()
    cache = Cache(default_cache_dir(cache_dir))
    gpus, gpu_error = _gpus()
    policy = lookup.Policy.runtime(verify=True)  # what the loader would launch; a corrupt entry is missing
    missing = []
    for e in plan_model(model, targets):
        if lookup.find(cache, key_parts(e.variant, e.arch), policy) is None:
            missing.append({"target": e.target.name, "variant": e.variant.label})
    bindings = dist_version("cuda-bindings") or dist_version("cuda-python")
    driver = _driver_version()
    from ..gemm.cublaslt import library_paths  # no torch, no CUDA: where the GEMM path's cuBLASLt would load from

    lt = library_paths()
    problems = [p for p in (bindings_driver_problem(bindings, driver), _remote_problem()) if p]
    report = {
        "musekern": __version__,
        "python": platform.python_version(),
        "nvidia-cutlass-dsl": dist_version("nvidia-cutlass-dsl"),
        "cuda-bindings": bindings,
        "torch": dist_version("torch"),
        "cublaslt": lt[0] if lt else None,
        "driver_version": driver,
        "gpus": gpus,
        "gpu_error": gpu_error,
        "cache_dir": str(cache.root),
        "cache_writable": not cache.read_only,
        "cache_entries": len(cache.entries()),
        records.FOLDER.name: records.summary(cache),
        "model": model.source,
        "tp": list(model.tensor_parallel_sizes),
        "tp_source": model.tp_source,
        "targets": [t.name for t in targets],
        "environment": environment(),
        "warnings": list(model.warnings),
        "problems": problems,
        "missing": missing,
        "ok": not missing and not problems,
    }
    if as_json:
        emit_json(report)
    else:
        rows = [[k, report[k] if report[k] is not None else "not installed" if k in (
            "nvidia-cutlass-dsl", "cuda-bindings", "torch") else "none"]
            for k in ("musekern", "python", "nvidia-cutlass-dsl", "cuda-bindings", "torch", "driver_version",
                      "cache_dir", "cache_writable", "cache_entries", "model")]
        rows.append(["cublaslt", report["cublaslt"] or "not found (the GEMM path takes torch.mm's algorithm)"])
        rows.append(["gemm tuning", "; ".join(f"{n} shapes on {s}" for s, n in report["gemm_tuning"].items())
                     or "none recorded (the first prepare_ops on a GPU measures and records them)"])
        rows.append(["gpus", "; ".join(f"{g['name']} ({g['arch']}, {g['sm_count']} SMs, target {g['target']})"
                                      for g in gpus) or (gpu_error or "none")])
        rows.append(["targets", ", ".join(report["targets"])])
        rows.append(["tp", f"{','.join(map(str, report['tp']))} (from {model.tp_source})"])
        rows += [[v["name"], f"{v['value'] or '(unset)'} ({v['source']})"] for v in report["environment"]]
        click.echo(table(rows, ["check", "value"]))
        for prob in problems:
            click.echo(f"problem: {prob}")
        if missing:
            click.echo("")
            click.echo(table([[m["target"], m["variant"]] for m in missing], ["target", "missing variant"]))
            click.echo(f"{len(missing)} planned variant(s) missing from the cache {cache.root}")
            log(f"fix: {_fix_command(plan, cache_dir, missing)}")
        else:
            click.echo("every planned variant is in the cache")
    if missing or problems:
        raise SystemExit(1)


def register(group: click.Group) -> None:
    group.add_command(doctor_cmd)
