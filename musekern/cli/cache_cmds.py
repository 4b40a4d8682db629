"""Cache commands: ls, verify, clean, stats, gc, explain, export, import.

Every command takes --cache-dir and --json; results (and their summary line) go to stdout, progress,
warnings, errors and fix commands to stderr (the rule is written in cli/__init__.py); exit 0 ok,
1 failure (the message names what is wrong and the command that fixes it), 2 usage.
Nothing here imports cutlass: these commands work on a deploy machine with the runtime only.
"""
from __future__ import annotations

import re
import time

import click

from ..store import hygiene, lookup
from .common import (
    EXIT_FAIL,
    Failure,
    cache_dir_option,
    emit_json,
    json_option,
    log,
    model_option,
    shard_option,
    table,
    target_option,
    tp_option,
)

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """'500M', '2GiB', '1.5g', '1048576' -> bytes (k/M/G are powers of 10, KiB/MiB/GiB of 2)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text or "")
    unit = m and m.group(2).lower()
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 500M, 2G, 1GiB, 1048576)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s', '2w' (or '1d12h') -> seconds."""
    text = (text or "").strip().lower()
    if not re.fullmatch(r"(\s*\d+(?:\.\d+)?\s*[smhdw])+", text):
        raise ValueError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 2w)")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhdw])", text)
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _open(cache_dir):
    from ..store.cache import Cache, default_cache_dir

    return Cache(default_cache_dir(cache_dir))


def _cd(cache) -> str:
    """The --cache-dir spelling to put in a suggested fix command."""
    return f" --cache-dir {cache.root}"


def _tp(tp) -> str:
    """The --tp spelling to put in a suggested fix command."""
    return f" --tp {','.join(map(str, tp))}" if tp else ""


def _writable(cache, what: str) -> None:
    from ..store.cache import ReadOnlyCacheError

    try:
        cache.require_writable(what)
    except ReadOnlyCacheError as e:
        raise Failure(str(e)) from None


# ---------------------------------------------------------------- ls
@click.command("ls")
@click.option("--kernel", default=None, help="Only entries of this kernel.")
@click.option("--arch", default=None, help="Only entries for this arch (e.g. sm_90a).")
@cache_dir_option
@json_option
def ls_cmd(kernel, arch, cache_dir, as_json):
    """List cache entries: key, kernel, arch, size, label."""
    cache = _open(cache_dir)
    entries = [e for e in cache.entries()
               if (kernel is None or e.kernel == kernel) and (arch is None or e.arch == arch)]
    if as_json:
        emit_json({"cache_dir": str(cache.root), "entries": [dict(e.summary(), last_used=cache.last_used(e))
                                                             for e in entries]})
        return
    rows = [[e.key[:16], e.kernel, e.arch, e.dsl_version, _human(e.size_bytes), e.label] for e in entries]
    click.echo(table(rows, ["key", "kernel", "arch", "dsl", "size", "label"]))
    click.echo(f"{len(entries)} entries in {cache.root}")


# ---------------------------------------------------------------- verify
@click.command("verify")
@click.option("--repair", is_flag=True, help="Remove bad entries so `musekern prepare` rebuilds them.")
@cache_dir_option
@json_option
def verify_cmd(repair, cache_dir, as_json):
    """Re-hash every entry; exit 1 naming each bad one (--repair removes them)."""
    cache = _open(cache_dir)
    keys = cache.entry_keys()
    bad = cache.audit()
    removed = []
    if bad and repair:
        _writable(cache, "repair")
        for key in bad:
            cache.remove(key)
            removed.append(key)
    ok = not bad or repair
    if as_json:
        emit_json({"cache_dir": str(cache.root), "ok": ok, "checked": len(keys),
                   "bad": [{"key": k, "path": str(cache.entry_path(k)), "problems": p} for k, p in bad.items()],
                   "removed": removed})
    else:
        for k, problems in bad.items():
            click.echo(f"BAD {k}  {cache.entry_path(k)}: {'; '.join(problems)}")
        click.echo(f"{len(keys)} entries checked, {len(bad)} bad" + (f", {len(removed)} removed" if repair else ""))
    if bad and repair:
        log(f"removed {len(removed)} bad entr{'y' if len(removed) == 1 else 'ies'}; rebuild with "
            f"`musekern prepare{_cd(cache)}` (with your --model/--target)")
    elif bad:
        log(f"musekern: error: {len(bad)} bad entr{'y' if len(bad) == 1 else 'ies'} in {cache.root}; "
            f"fix with `musekern verify --repair{_cd(cache)}` then `musekern prepare{_cd(cache)}`")
    if not ok:
        raise SystemExit(EXIT_FAIL)


# ---------------------------------------------------------------- clean
@click.command("clean")
@click.option("--stale", is_flag=True, help="Also remove entries that no recorded plan needs.")
@click.option("--all", "all_", is_flag=True, help="Remove every entry.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@cache_dir_option
@json_option
def clean_cmd(stale, all_, dry_run, cache_dir, as_json):
    """Remove crash debris (old temp dirs); --stale: unneeded entries; --all: everything."""
    from ..store.cache import CacheError

    cache = _open(cache_dir)
    if not dry_run:
        _writable(cache, "clean")
    removed, tmp = [], 0
    if all_:
        removed = [e.summary() for e in cache.entries()]
        if not dry_run:
            hygiene.clear(cache)
    else:
        if stale:
            try:
                doomed = hygiene.stale_entries(cache)
            except CacheError as e:
                raise Failure(str(e)) from None
            removed = [e.summary() for e in doomed]
            if not dry_run:
                for e in doomed:
                    cache.remove(e.key)
        if not dry_run:
            tmp = hygiene.clean_tmp(cache)
    if as_json:
        emit_json({"cache_dir": str(cache.root), "dry_run": dry_run, "removed": removed, "temp_dirs_removed": tmp})
    else:
        for s in removed:
            click.echo(f"{'would remove' if dry_run else 'removed'} {s['key'][:16]} {s['label']}")
        if dry_run:
            click.echo(f"{len(removed)} entries would be removed; nothing was touched ({cache.root})")
        else:
            click.echo(f"{len(removed)} entries removed, {tmp} temp dirs removed ({cache.root})")


# ---------------------------------------------------------------- stats
@click.command("stats")
@cache_dir_option
@json_option
def stats_cmd(cache_dir, as_json):
    """Entries and bytes, per kernel and per arch."""
    cache = _open(cache_dir)
    s = hygiene.stats(cache)
    if as_json:
        emit_json(s)
        return
    click.echo(f"cache {s['cache_dir']}{' (read-only)' if s['read_only'] else ''}: {s['entries']} entries, "
               f"{_human(s['bytes'])}")
    rows = [["kernel", k, v["entries"], _human(v["bytes"])] for k, v in sorted(s["by_kernel"].items())]
    rows += [["arch", k, v["entries"], _human(v["bytes"])] for k, v in sorted(s["by_arch"].items())]
    if rows:
        click.echo(table(rows, ["by", "name", "entries", "size"]))
    if s["uncommitted"]:
        log(f"musekern: warning: {s['uncommitted']} uncommitted/damaged entry dirs: run "
            f"`musekern verify --repair{_cd(cache)}`")


# ---------------------------------------------------------------- gc
@click.command("gc")
@click.option("--max-size", default=None, metavar="SIZE", help="Evict least recently used entries down to SIZE "
              "(e.g. 500M, 2G, 1GiB).")
@click.option("--older-than", default=None, metavar="DURATION", help="Evict entries unused for DURATION "
              "(e.g. 30d, 12h).")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@cache_dir_option
@json_option
def gc_cmd(max_size, older_than, dry_run, cache_dir, as_json):
    """Evict entries by last use (stamps the loader writes on writable caches)."""
    if max_size is None and older_than is None:
        raise click.UsageError("give --max-size SIZE and/or --older-than DURATION, e.g. `musekern gc --max-size 2G`")
    try:
        size = parse_size(max_size) if max_size is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-size") from None
    try:
        age = parse_duration(older_than) if older_than is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--older-than") from None
    cache = _open(cache_dir)
    if not dry_run:
        _writable(cache, "collect garbage")
    now = time.time()
    doomed = hygiene.gc(cache, max_size=size, older_than=age, now=now, dry_run=dry_run)
    after = hygiene.stats(cache)
    if dry_run:  # nothing was removed: report what would be left
        after = {**after, "entries": after["entries"] - len(doomed),
                 "bytes": after["bytes"] - sum(e.size_bytes for e in doomed)}
    if as_json:
        emit_json({"cache_dir": str(cache.root), "dry_run": dry_run,
                   "removed": [e.summary() for e in doomed], "entries_left": after["entries"],
                   "bytes_left": after["bytes"]})
        return
    for e in doomed:
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.key[:16]} {e.label}")
    click.echo(f"{len(doomed)} entries {'would be ' if dry_run else ''}removed; {after['entries']} entries, "
               f"{_human(after['bytes'])} left ({cache.root})")


# ---------------------------------------------------------------- explain
def _planned_parts(model_path, target_names, tp=None, shard=None):
    """(model, targets, [(PlanEntry, KeyParts)]) of the model's plan, or of its shard (K, N): the variants
    `prepare --shard K/N` of the same plan builds (variants.shard_plan), keyed as prepare keys them."""
    from ..build.prepare import plan_keys
    from ..variants import plan_model, shard_plan
    from .common import load_model, resolve_targets

    model = load_model(model_path, tp)
    targets = resolve_targets(target_names, model)
    entries = plan_model(model, targets)
    if shard:
        entries = shard_plan(entries, *shard)
    return model, targets, list(zip(entries, plan_keys(entries), strict=True))


def _parts_json(entry) -> dict:
    return {"key": entry.key, "path": str(entry.path), "label": entry.label, "parts": entry.manifest.get("key_parts")}


@click.command("explain")
@click.argument("what", metavar="LABEL_OR_KEY")
@model_option
@target_option
@tp_option
@cache_dir_option
@json_option
def explain_cmd(what, model_path, target_names, tp, cache_dir, as_json):
    """Print the key parts of an entry (key or key prefix) or of a variant label.

    For a label, the matching entries are shown; with --model/--target the planned key is
    computed too, and when it is missing the nearest entry and the parts that differ are named.
    """
    from ..store.cache import CacheError
    from ..store.keys import is_key

    cache = _open(cache_dir)
    w = what.strip().lower()
    result: dict = {"cache_dir": str(cache.root), "query": what}
    if re.fullmatch(r"[0-9a-f]{6,64}", w):
        matches = [k for k in cache.entry_keys() if k.startswith(w)]
        if len(matches) > 1:
            raise click.UsageError(f"key prefix {what!r} is ambiguous ({len(matches)} entries); give more digits")
        if not matches:
            raise Failure(f"no entry with key {what!r} in {cache.root}; `musekern ls{_cd(cache)}` lists them")
        entry = cache.get(matches[0])
        problems = cache.verify_entry(matches[0])
        if entry is None:
            raise Failure(f"entry {matches[0]} is damaged ({'; '.join(problems)}): run `musekern verify --repair"
                          f"{_cd(cache)}`")
        result.update(kind="key", entry=_parts_json(entry), problems=problems)
        if as_json:
            emit_json(result)
            return
        _print_parts(entry)
        click.echo(f"integrity: {'ok' if not problems else '; '.join(problems)}")
        return

    # a variant label (normalise spacing); entries whose manifest label matches
    label = re.sub(r"\s+", "", what)
    entries = [e for e in cache.entries() if e.label.replace(" ", "") == label]
    result.update(kind="label", entries=[_parts_json(e) for e in entries])
    planned = []
    if model_path or target_names or tp:
        model, _, pairs = _planned_parts(model_path, target_names, tp)
        result["warnings"] = list(model.warnings)
        policy = lookup.Policy.build(verify=False)
        for pe, parts in pairs:
            if pe.variant.label.replace(" ", "") != label:
                continue
            hit = lookup.find(cache, parts, policy)
            item = {"target": pe.target.name, "arch": pe.arch, "key": parts.key(), "parts": parts.to_json(),
                    "present": hit is not None, "entry": hit.key if hit else None}
            if hit is None:
                near, diff = lookup.nearest(cache, parts)
                item.update(nearest=near.key if near else None, differs_in=diff,
                            differences=parts.describe_differences(near.parts) if near else [],
                            message=lookup.explain_miss(cache, parts))
            planned.append(item)
        if not planned:
            raise Failure(f"{what!r} is not in the plan of this model/target; `musekern plan` lists the variants")
        result["planned"] = planned
    if not entries and not planned:
        if is_key(w):
            raise Failure(f"no entry {w} in {cache.root}")
        raise Failure(f"no entry labelled {what!r} in {cache.root}; `musekern ls{_cd(cache)}` lists the entries, "
                      "or pass --model/--target to compute the planned key")
    if as_json:
        emit_json(result)
        return
    for e in entries:
        try:
            _print_parts(e)
        except CacheError as err:
            click.echo(f"{e.key}: {err}")
        click.echo("")
    for p in planned:
        click.echo(f"planned for {p['target']} ({p['arch']}): key {p['key']} "
                   + ("present" if p["present"] else "MISSING"))
        if not p["present"]:
            click.echo(f"  {p['message']}")
            log(f"fix: musekern prepare --target {p['target']}{f' --model {model_path}' if model_path else ''}"
                f"{_tp(tp)}{_cd(cache)}")


def _print_parts(entry) -> None:
    parts = entry.parts
    click.echo(f"key          {entry.key}")
    click.echo(f"path         {entry.path}")
    click.echo(f"label        {entry.label}")
    click.echo(f"kernel       {parts.kernel}")
    click.echo(f"variant      {', '.join(f'{k}={v}' for k, v in parts.variant)}")
    click.echo(f"arch         {parts.arch}")
    click.echo(f"source       {parts.source_sha256}")
    click.echo(f"dsl_version  {parts.dsl_version}")
    click.echo(f"abi_version  {parts.abi_version}")


# ---------------------------------------------------------------- export / import
@click.command("export")
@model_option
@target_option
@tp_option
@shard_option
@click.option("--all", "all_", is_flag=True, help="Export every entry instead of a model's plan.")
@click.option("--key", "keys", multiple=True, help="Export this entry (repeatable) instead of a model's plan.")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Bundle to write (.tar, or .tar.gz).")
@cache_dir_option
@json_option
def export_cmd(model_path, target_names, tp, shard, all_, keys, output, cache_dir, as_json):
    """Write a reproducible bundle (tar) of the model's planned entries, or of shard K/N of them (what
    `prepare --shard K/N` built), or --all / --key entries."""
    from ..store.bundle import export_bundle
    from ..store.cache import CacheError

    cache = _open(cache_dir)
    plan_name = None
    warnings: list[str] = []
    if all_ or keys:
        if model_path or target_names or tp or shard:
            raise click.UsageError("give either --model/--target/--tp/--shard or --all/--key, not both")
        chosen = [e.key for e in cache.entries()] if all_ else []
        for k in keys:
            matches = [x for x in cache.entry_keys() if x.startswith(k.lower())]
            if len(matches) != 1:
                raise Failure(f"--key {k}: {'no' if not matches else 'more than one'} matching entry in "
                              f"{cache.root}; `musekern ls{_cd(cache)}` lists them")
            chosen.append(matches[0])
    else:
        model, targets, pairs = _planned_parts(model_path, target_names, tp, shard)
        warnings = list(model.warnings)
        policy = lookup.Policy.build(verify=False)
        chosen, missing = [], []
        for pe, parts in pairs:
            hit = lookup.find(cache, parts, policy)
            (chosen.append(hit.key) if hit else missing.append(pe))
        sh = f" --shard {shard[0]}/{shard[1]}" if shard else ""
        what = f"shard {shard[0]}/{shard[1]} of the plan" if shard else "the plan"
        if missing:
            tnames = " ".join(f"--target {t.name}" for t in targets)
            mpart = f" --model {model_path}" if model_path else ""
            for pe in missing:
                log(f"missing: {pe.target.name} {pe.variant.label}")
            raise Failure(f"{len(missing)} of the {len(pairs)} variants of {what} are not in {cache.root}; "
                          f"run `musekern prepare{mpart} {tnames}{_tp(tp)}{sh}{_cd(cache)}` first")
        # A shard's bundle records its own plan name: importing every shard into one cache then records every
        # shard's keys (one shared name would keep only the last import's, and `clean --stale` would drop the rest).
        plan_name = f"{model.source}|{','.join(t.name for t in targets)}" + (f"|shard {shard[0]}/{shard[1]}"
                                                                           if shard else "")
    try:
        index = export_bundle(cache, chosen, output, plan_name=plan_name)
    except CacheError as e:
        raise Failure(str(e)) from None
    except OSError as e:
        raise Failure(f"cannot write {output}: {e.strerror or e}") from None
    n = len(index["entries"])
    if as_json:
        emit_json({"cache_dir": str(cache.root), "output": str(output), "entries": n,
                   "keys": [x["key"] for x in index["entries"]], "plan": plan_name, "warnings": warnings})
    else:
        click.echo(f"exported {n} entries to {output}")


@click.command("import")
@click.argument("bundle", type=click.Path(dir_okay=False, exists=True))
@cache_dir_option
@json_option
def import_cmd(bundle, cache_dir, as_json):
    """Verify a bundle and add its entries to the cache (bad entries are rejected, exit 1)."""
    from ..store.bundle import BundleError, import_bundle
    from ..store.cache import ReadOnlyCacheError

    cache = _open(cache_dir)
    try:
        report = import_bundle(cache, bundle)
    except (BundleError, ReadOnlyCacheError) as e:
        raise Failure(str(e)) from None
    if as_json:
        emit_json({"cache_dir": str(cache.root), "bundle": str(bundle), **report.to_json()})
    else:
        for key, reason in report.rejected:
            click.echo(f"REJECTED {key[:16]}: {reason}")
        click.echo(f"{len(report.added)} added, {len(report.present)} already present, "
                   f"{len(report.rejected)} rejected ({cache.root})")
    if report.rejected:
        log(f"musekern: error: {len(report.rejected)} bundle entries failed verification and were not imported; "
            "re-export the bundle from a verified cache (`musekern verify` there, then `musekern export`)")
        raise SystemExit(EXIT_FAIL)


COMMANDS = (ls_cmd, verify_cmd, clean_cmd, stats_cmd, gc_cmd, explain_cmd, export_cmd, import_cmd)


def register(group: click.Group) -> None:
    """Add the cache commands to `group` (the `musekern` console script)."""
    for cmd in COMMANDS:
        group.add_command(cmd)
