"""`musekern plan` and `musekern prepare`."""
from __future__ import annotations

import click

from ..plan import REGISTRY, PlanEntry, plan_model, shard_plan, variant_from_label
from .common import (
    Failure,
    Progress,
    UsageFailure,
    cache_dir_option,
    emit_json,
    json_option,
    log,
    plan_options,
    shard_option,
    sign_key_option,
    table,
    trusted_keys_option,
    warn,
    wide_option,
)


def _plan_rows(entries: list[PlanEntry], model) -> list[dict]:
    """One row per (target, TP rank, variant): what `plan` prints (each kernel adds its own columns)."""
    rows = []
    for e in entries:
        v = e.variant
        for tp in e.tps:
            shard = model.shard(tp) if model else None
            row = {"target": e.target.name, "arch": e.arch, "tp": tp, "kernel": e.kernel, "label": v.label}
            row.update(REGISTRY[e.kernel].plan_row(v, model, shard, e.target))
            rows.append(row)
    rows.sort(key=lambda r: (r["target"], r["tp"], r["kernel"], r["label"]))
    return rows


def _entries_for(model, targets, variant_labels) -> list[PlanEntry]:
    if not variant_labels:
        return plan_model(model, targets)
    try:
        variants = [variant_from_label(lbl) for lbl in variant_labels]
    except ValueError as e:
        raise UsageFailure(str(e)) from None
    return sorted({PlanEntry(t, v, ()) for t in targets for v in variants}, key=PlanEntry.sort_key)


def _cache_failure(cache, e: OSError) -> Failure:
    """The cache directory cannot be created or written (a path under /proc, a file in the way)."""
    from ..store import fs

    return Failure(fs.describe(e, e.filename or cache.root, "cannot write the cache at"))


def _done_line(r) -> str:
    """A finished variant in a log without a terminal: status, time, label, target."""
    return f"{r.status} {r.seconds:.1f}s {r.label} ({r.target})" + (f": {r.error}" if r.error else "")


def model_json(model) -> dict:
    """What every --json result that plans says about the model: source, TP sizes and where they came
    from, dtypes, and the warnings (also said on stderr)."""
    return {"model": model.source, "tp": list(model.tensor_parallel_sizes), "tp_source": model.tp_source,
            "dtype": model.dtype, "checkpoint_dtype": model.checkpoint_dtype, "kv_cache_dtype": model.kv_cache_dtype,
            "weight_format": model.weight_format.name, "warnings": list(model.warnings)}


@click.command("plan")
@plan_options
@wide_option
@json_option
def plan_cmd(plan, as_json):
    """List every kernel variant the model needs, per target and TP rank."""
    model, targets = plan.load()
    entries = plan_model(model, targets)
    rows = _plan_rows(entries, model)
    if as_json:
        emit_json({**model_json(model), "targets": [t.name for t in targets],
                   "variants": [e.to_json() for e in entries], "rows": rows})
        return
    cols = ["target", "tp", "kernel", "N", "heads", "k_split", "stages", "tiles", "fixed_rows", "tokens", "label"]
    click.echo(table([[("" if r.get(c) is None else r.get(c, "")) for c in cols] for r in rows], cols))
    kv = "" if model.kv_cache_dtype == "bf16" else f" (KV cache {model.kv_cache_dtype})"
    wf = "" if not model.weight_format.fp8 else f" (weights {model.weight_format.name})"
    click.echo(f"{len(entries)} distinct variants for {len(targets)} target(s): {model.source}{kv}{wf}")


@click.command("prepare")
@plan_options
@click.option("--variant", "variant_labels", multiple=True,
              help="Build this variant (a label from `musekern plan`) instead of the model's plan. Repeatable.")
@cache_dir_option
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Parallel compiles (processes).")
@shard_option
@click.option("--remote", default=None, envvar="MUSEKERN_REMOTE",
              help="HTTP cache (Bazel protocol) to pull from [env: MUSEKERN_REMOTE].")
@click.option("--upload", is_flag=True, help="Push entries this run built or has to --remote.")
@sign_key_option
@trusted_keys_option
@wide_option
@json_option
def prepare_cmd(plan, variant_labels, cache_dir, jobs, shard, remote, upload, sign_key, trusted_keys, as_json):
    """Compile every kernel variant the model needs into the cache (no GPU needed)."""
    from ..builder import BuildExtraMissing
    from ..builder.prepare import BUILT, FAILED, HIT, PULLED, prepare
    from ..store.cache import Cache, ReadOnlyCacheError, default_cache_dir
    from ..store.signing import SecretKey, TrustedKeys

    model, targets = plan.load()
    entries = _entries_for(model, targets, variant_labels)
    if upload and not remote:
        raise UsageFailure("--upload needs --remote URL (or MUSEKERN_REMOTE)")
    cache = Cache(default_cache_dir(cache_dir))
    sign = SecretKey.from_env(sign_key)  # SigningError: one line (the group maps CacheErrors)
    rem = None
    if remote:
        from ..store.remote import RemoteCache, RemoteError

        try:
            rem = RemoteCache.from_env(remote, upload=upload, trusted=TrustedKeys.from_env(trusted_keys),
                                       sign_key=sign)
        except RemoteError as e:
            raise UsageFailure(f"--remote: {e}") from None
    if not cache.root.exists():  # a root that cannot exist (under /proc, below a file) fails here, in one line
        cache.require_writable("prepare", "prepare")
        try:
            cache.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _cache_failure(cache, e) from None
    # the whole plan is recorded (also in a shard run): `musekern clean --stale` keeps what some plan needs
    plan_name = None if variant_labels else plan.record_name(model, targets)
    n = len(shard_plan(entries, *shard)) if shard else len(entries)
    log(f"musekern prepare: {n} variant(s) for {', '.join(t.name for t in targets)} -> {cache.root}")
    try:
        with Progress(n, "prepare", _done_line, show=lambda r: r.label) as done:
            report = prepare(entries, cache, jobs=jobs, remote=rem, upload=upload, on_done=done,
                             plan_name=plan_name, shard=shard, sign=sign)
    except BuildExtraMissing as e:
        raise Failure(str(e)) from None
    except ReadOnlyCacheError as e:
        raise Failure(str(e)) from None
    except OSError as e:
        raise _cache_failure(cache, e) from None
    for w in report.warnings:
        warn(w)
    for r in report.results:
        if r.status == FAILED:
            log(f"musekern: error: {r.label} ({r.target}): {r.error}")
    if as_json:
        emit_json({**model_json(model), "cache_dir": str(cache.root), "targets": [t.name for t in targets],
                   **report.to_json(), "warnings": [*model.warnings, *report.warnings]})
    else:
        rows = [[r.target, r.arch, r.status, f"{r.seconds:.1f}s" if r.status == BUILT else "", r.key[:12], r.label]
                for r in report.results]
        click.echo(table(rows, ["target", "arch", "status", "time", "key", "variant"]))
        n = len(report.results)
        evicted = f"; {len(report.trimmed)} other entries evicted by the size policy" if report.trimmed else ""
        if report.count(HIT) == n:
            click.echo(f"all {n} variants already in the cache; nothing to {'build' if evicted else 'do'}{evicted} "
                       f"({cache.root})")
        else:
            click.echo(f"{report.count(BUILT)} built, {report.count(PULLED)} pulled, {report.count(HIT)} cached, "
                       f"{report.count(FAILED)} failed{evicted} -> {cache.root}")
    if not report.ok:
        raise SystemExit(1)


def register(group: click.Group) -> None:
    group.add_command(plan_cmd)
    group.add_command(prepare_cmd)
