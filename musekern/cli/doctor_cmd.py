"""`musekern doctor`: what is installed, which GPU, which cache, and what the model still misses."""
from __future__ import annotations

import platform

import click

from .. import __version__
from ..store.keys import dist_version
from ..variants import plan_model
from .common import (
    cache_dir_option,
    emit_json,
    json_option,
    load_model,
    model_option,
    resolve_targets,
    table,
    target_option,
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


@click.command("doctor")
@model_option
@target_option
@cache_dir_option
@json_option
def doctor_cmd(model_path, target_names, cache_dir, as_json):
    """Report versions, GPU and driver, the cache, and the model's variants missing from it (exit 1 if any)."""
    from ..store import lookup
    from ..store.cache import Cache, default_cache_dir
    from ..store.keys import key_parts

    model = load_model(model_path)
    targets = resolve_targets(target_names, model)
    cache = Cache(default_cache_dir(cache_dir))
    gpus, gpu_error = _gpus()
    policy = lookup.Policy.runtime(verify=True)  # what the loader would launch; a corrupt entry is missing
    missing = []
    for e in plan_model(model, targets):
        if lookup.find(cache, key_parts(e.variant, e.arch), policy) is None:
            missing.append({"target": e.target.name, "variant": e.variant.label})
    report = {
        "musekern": __version__,
        "python": platform.python_version(),
        "nvidia-cutlass-dsl": dist_version("nvidia-cutlass-dsl"),
        "cuda-bindings": dist_version("cuda-bindings") or dist_version("cuda-python"),
        "torch": dist_version("torch"),
        "driver_version": _driver_version(),
        "gpus": gpus,
        "gpu_error": gpu_error,
        "cache_dir": str(cache.root),
        "cache_writable": not cache.read_only,
        "cache_entries": len(cache.entries()),
        "model": model.source,
        "targets": [t.name for t in targets],
        "missing": missing,
        "ok": not missing,
    }
    if as_json:
        emit_json(report)
    else:
        rows = [[k, report[k] if report[k] is not None else "not installed" if k in (
            "nvidia-cutlass-dsl", "cuda-bindings", "torch") else "none"]
            for k in ("musekern", "python", "nvidia-cutlass-dsl", "cuda-bindings", "torch", "driver_version",
                      "cache_dir", "cache_writable", "cache_entries", "model")]
        rows.append(["gpus", "; ".join(f"{g['name']} ({g['arch']}, {g['sm_count']} SMs, target {g['target']})"
                                      for g in gpus) or (gpu_error or "none")])
        rows.append(["targets", ", ".join(report["targets"])])
        click.echo(table(rows, ["check", "value"]))
        if missing:
            click.echo(f"{len(missing)} planned variant(s) missing from the cache, e.g. {missing[0]['variant']}; "
                       f"fix: musekern prepare --target {missing[0]['target']}"
                       + (f" --model {model_path}" if model_path else "")
                       + (f" --cache-dir {cache_dir}" if cache_dir else ""))
        else:
            click.echo("every planned variant is in the cache")
    if missing:
        raise SystemExit(1)


def register(group: click.Group) -> None:
    group.add_command(doctor_cmd)
