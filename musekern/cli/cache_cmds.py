"""Cache commands: ls, verify, clean, stats, gc, explain, export, import.

Every command takes --cache-dir and --json; results (and their summary line) go to stdout, progress,
warnings, errors and fix commands to stderr (the rule is written in cli/__init__.py); exit 0 ok,
1 failure (the message names what is wrong and the command that fixes it), 2 usage.
A cache that cannot be used (not a directory, unreadable, read-only for a write, disk full) is one
error line naming the path and the fix, never a traceback (`register` maps the store's errors).
Nothing here imports cutlass: these commands work on a deploy machine with the runtime only.
"""
from __future__ import annotations

import re
import time

import click

from ..env import human_size, parse_size
from ..gemm import records as gemm_records
from ..store import hygiene, lookup, record_folders
from .common import (
    EXIT_FAIL,
    Failure,
    UsageFailure,
    cache_dir_option,
    emit_json,
    json_option,
    log,
    one_line_errors,
    plan_options,
    shard_option,
    sign_key_option,
    table,
    trusted_keys_option,
    warn,
    wide_option,
)

__all__ = ["parse_size", "parse_duration", "register"]
MIN_KEY_PREFIX = 6  # hex digits of a key that `explain` takes as a key prefix
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s', '2w' (or '1d12h') -> seconds."""
    text = (text or "").strip().lower()
    if not re.fullmatch(r"(\s*\d+(?:\.\d+)?\s*[smhdw])+", text):
        raise ValueError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 2w)")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhdw])", text)
    total = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if total > 100 * 365 * 86400:
        raise ValueError(f"duration {text!r} is longer than a century")
    return total


_human = human_size


def _open(cache_dir, must_exist: bool = False):
    """The cache, its directory checked: not a directory or unreadable (or, must_exist, missing) is a CacheError
    that `register`'s mapping turns into one error line."""
    from ..store.cache import Cache, default_cache_dir

    cache = Cache(default_cache_dir(cache_dir))
    cache.check_root(must_exist=must_exist)
    return cache


def _cd(cache) -> str:
    """The --cache-dir spelling to put in a suggested fix command."""
    return f" --cache-dir {cache.root}"


def _writable(cache, what: str, command: str) -> None:
    cache.require_writable(what, command)  # CacheError: one line naming `musekern <command>`


# ---------------------------------------------------------------- ls
@click.command("ls")
@click.option("--kernel", default=None, help="Only entries of this kernel.")
@click.option("--arch", default=None, help="Only entries for this arch (e.g. sm_90a).")
@cache_dir_option
@wide_option
@json_option
def ls_cmd(kernel, arch, cache_dir, as_json):
    """List cache entries: key, kernel, arch, size, label, and whether each verifies (BAD: does not)."""
    cache = _open(cache_dir)
    rows = []
    for key in cache.entry_keys():
        insp = cache.inspect(key)
        if insp.status in ("missing", "gone"):  # removed while we listed
            continue
        e = insp.entry
        if (kernel is not None and e.kernel != kernel) or (arch is not None and e.arch != arch):
            continue
        rows.append((e, insp))
    bad = [insp for _, insp in rows if insp.status != "sound"]
    if as_json:
        emit_json({"cache_dir": str(cache.root), "entries": [
            dict(e.summary(), last_used=cache.last_used(e), ok=insp.status == "sound", problems=list(insp.problems))
            for e, insp in rows]})
    else:
        click.echo(table([[e.key[:16], "ok" if insp.status == "sound" else "BAD", e.kernel, e.arch, e.dsl_version,
                           _human(e.size_bytes), e.label] for e, insp in rows],
                         ["key", "state", "kernel", "arch", "dsl", "size", "label"]))
        click.echo(f"{len(rows)} entries in {cache.root}")
    if bad:
        log(f"musekern: warning: {len(bad)} entr{'y does' if len(bad) == 1 else 'ies do'} not verify (BAD): "
            f"`musekern verify{_cd(cache)}` says why, `musekern verify --repair{_cd(cache)}` removes them")


# ---------------------------------------------------------------- verify
@click.command("verify")
@click.option("--repair", is_flag=True, help="Remove bad entries so `musekern prepare` rebuilds them.")
@cache_dir_option
@json_option
def verify_cmd(repair, cache_dir, as_json):
    """Re-check every entry (manifest digest, key, ABI, cubin hash); exit 1 naming each bad one (--repair
    removes them, each re-checked under its lock first). A missing cache directory is an error."""
    cache = _open(cache_dir, must_exist=True)
    if repair:
        hygiene.check_own_dirs(cache, "verify --repair")  # refused before anything is removed
    keys = cache.entry_keys()
    bad, gone = {}, []
    for k in keys:
        insp = cache.inspect(k)
        if insp.status == "bad":
            bad[k] = list(insp.problems)
        elif insp.status in ("gone", "missing"):  # removed by gc/clean while we checked: not damage
            gone.append(k)
    fixed = {"removed": {}, "kept": [], "busy": [], "gone": []}
    if bad and repair:
        _writable(cache, "repair", "verify --repair")
        fixed = hygiene.repair(cache)
        bad = {k: v for k, v in bad.items() if k in fixed["bad"]}  # the re-check decides
    removed = fixed["removed"]
    left = [k for k in bad if k not in removed and k not in fixed["kept"] and k not in fixed["gone"]]
    ok = not bad or (repair and not left)
    if as_json:
        emit_json({"cache_dir": str(cache.root), "ok": ok, "checked": len(keys),
                   "bad": [{"key": k, "path": str(cache.entry_path(k)), "problems": p} for k, p in bad.items()],
                   "gone": gone, "removed": sorted(removed), "busy": fixed["busy"], "recovered": fixed["kept"]})
    else:
        for k, problems in bad.items():
            click.echo(f"BAD {k}  {cache.entry_path(k)}: {'; '.join(problems)}")
        click.echo(f"{len(keys)} entries checked, {len(bad)} bad"
                   + (f", {len(gone)} removed meanwhile by another command" if gone else "")
                   + (f", {len(removed)} removed" if repair else ""))
    for line in fixed.get("skipped", ()):
        log(f"musekern: warning: {line}")
    if fixed["busy"]:
        log(f"musekern: warning: {len(fixed['busy'])} bad entr{'y is' if len(fixed['busy']) == 1 else 'ies are'} "
            f"being rebuilt by a running prepare; run `musekern verify{_cd(cache)}` when it is done")
    if bad and repair and removed:
        log(f"removed {len(removed)} bad entr{'y' if len(removed) == 1 else 'ies'}; rebuild with "
            f"`musekern prepare{_cd(cache)}` (with your --model/--target)")
    elif bad and not repair:
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
    """Remove staging debris of dead writers (at once; a running writer's is never touched); --stale: entries
    no recorded plan needs; --all: every entry. Entries a running prepare holds are kept."""
    cache = _open(cache_dir)
    if not dry_run:
        _writable(cache, "clean", "clean")
    hygiene.check_own_dirs(cache, "clean")  # a link where tmp/, plans/... should be: refused before anything goes
    doomed, busy, skipped = [], [], []
    records = {f.name: [] for f in record_folders.folders()}  # a record folder -> the names removed (the GEMM tuning)
    if all_:
        doomed = cache.entries()
    elif stale:
        doomed = hygiene.stale_entries(cache)  # CacheError (no plan recorded): one line with its fix
    summaries = {e.key: e.summary() for e in doomed}
    if dry_run:
        removed = list(summaries)
        tmp = hygiene.clean_tmp(cache, dry_run=True)
        records = {f.name: f.files(cache) for f in record_folders.folders()} if all_ else records
    elif all_:
        result = hygiene.clear(cache)
        removed, busy, tmp, records, skipped = (result["removed"], result["busy"], result["tmp"], result["records"],
                                                result["skipped"])
    else:
        done = {e.key: hygiene.remove_entry(cache, e.key, command="clean", skipped=skipped) for e in doomed}
        removed, busy = ([k for k, r in done.items() if r == want] for want in ("removed", "busy"))
        tmp = hygiene.clean_tmp(cache, skipped=skipped)
    rows = [summaries.get(k) or {"key": k, "label": "?"} for k in removed]
    for line in skipped:
        log(f"musekern: warning: {line}")
    if as_json:
        emit_json({"cache_dir": str(cache.root), "dry_run": dry_run, "removed": rows, "busy": busy,
                   "temp_dirs_removed": tmp, **{f"{k}_removed": v for k, v in records.items()}, "skipped": skipped})
        return
    for r in rows:
        click.echo(f"{'would remove' if dry_run else 'removed'} {r['key'][:16]} {r['label']}")
    for f in record_folders.folders():
        for name in records.get(f.name, ()):
            click.echo(f"{'would remove' if dry_run else 'removed'} {f.what} {name}")
    if dry_run:
        click.echo(f"{len(rows)} entries and {tmp} staging dirs would be removed; nothing was touched ({cache.root})")
    else:
        click.echo(f"{len(rows)} entries removed, {tmp} staging dirs of dead writers removed ({cache.root})")
    if busy:
        log(f"musekern: warning: {len(busy)} entr{'y' if len(busy) == 1 else 'ies'} kept: a running prepare holds "
            f"{'it' if len(busy) == 1 else 'them'}; run `musekern clean{_cd(cache)}` again when it is done")


# ---------------------------------------------------------------- stats
@click.command("stats")
@click.option("--zero", is_flag=True, help="Zero the hit/miss/built/pulled counters.")
@cache_dir_option
@json_option
def stats_cmd(zero, cache_dir, as_json):
    """Entries and bytes per kernel and arch; hit/miss/built/pulled counters of prepare and the runtime loader
    (kept in the cache, never on a read-only one); staging dirs of running and of dead writers; the size policy."""
    cache = _open(cache_dir)
    if zero:
        hygiene.zero_counters(cache)
    s = hygiene.stats(cache)
    if s["policy_problem"]:
        log(f"musekern: warning: {s['policy_problem']}; no size policy is applied meanwhile")
    if s["not_own_dirs"]:
        log(f"musekern: warning: {'; '.join(s['not_own_dirs'])}, where the cache keeps a directory of its own: "
            "maintenance (clean, gc, verify --repair) refuses this cache until that is removed (`rm PATH`)")
    if as_json:
        emit_json(s)
        return
    click.echo(f"cache {s['cache_dir']}{' (read-only)' if s['read_only'] else ''}: {s['entries']} entries, "
               f"{_human(s['bytes'])}")
    c = s["counters"]
    looked = c["hit"] + c["miss"]
    click.echo(f"lookups: {c['hit']} hit, {c['miss']} missed" + (f" ({100 * c['hit'] / looked:.0f}% hits)"
                                                                   if looked else "")
               + f"; {c['built']} built, {c['pulled']} pulled")
    if s["max_size"] is not None:
        click.echo(f"size policy: at most {_human(s['max_size'])} (from {s['max_size_source']})")
    for scope, shapes in s[gemm_records.FOLDER.name].items():
        click.echo(f"GEMM tuning: {shapes} shapes measured on {scope}")
    rows = [["kernel", k, v["entries"], _human(v["bytes"])] for k, v in sorted(s["by_kernel"].items())]
    rows += [["arch", k, v["entries"], _human(v["bytes"])] for k, v in sorted(s["by_arch"].items())]
    if rows:
        click.echo(table(rows, ["by", "name", "entries", "size"]))
    st = s["staging"]
    if st["live"] or st["debris"]:
        click.echo(f"staging: {st['live']} dirs of running writers, {st['debris']} of dead writers "
                   f"({_human(st['debris_bytes'])})")
    if st["debris"]:
        log(f"musekern: warning: staging debris of dead writers: `musekern clean{_cd(cache)}` removes it")
    if s["uncommitted"]:
        log(f"musekern: warning: {s['uncommitted']} uncommitted/damaged entry dirs: run "
            f"`musekern verify --repair{_cd(cache)}`")


# ---------------------------------------------------------------- gc
def _size_option(value, hint: str):
    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None


@click.command("gc")
@click.option("--max-size", default=None, metavar="SIZE", help="Evict least recently used entries down to SIZE "
              "(e.g. 500M, 2G, 1GiB).")
@click.option("--older-than", default=None, metavar="DURATION", help="Evict entries unused for DURATION "
              "(e.g. 30d, 12h).")
@click.option("--set-max-size", "set_max", default=None, metavar="SIZE|none", help="Keep SIZE as this cache's "
              "lasting size policy (policy.json in the cache dir; `none` drops it) and trim to it now; prepare "
              "trims to it after each run, and a plain `musekern gc` uses it. MUSEKERN_MAX_SIZE wins over it.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@cache_dir_option
@json_option
def gc_cmd(max_size, older_than, set_max, dry_run, cache_dir, as_json):
    """Evict entries by last use (stamps the loader writes on writable caches), down to --max-size or the
    cache's size policy. Entries a running prepare holds, or used since gc looked, are kept."""
    size = _size_option(max_size, "--max-size") if max_size is not None else None
    new_policy = None
    if set_max is not None:
        if dry_run:
            raise click.UsageError("--set-max-size writes the policy: leave out --dry-run")
        new_policy = None if set_max.strip().lower() == "none" else _size_option(set_max, "--set-max-size")
    try:
        age = parse_duration(older_than) if older_than is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--older-than") from None
    cache = _open(cache_dir)
    if not dry_run:
        _writable(cache, "collect garbage", "gc")
    if set_max is not None:
        hygiene.set_max_size(cache, new_policy)
        log(f"size policy of {cache.root}: " + (f"at most {_human(new_policy)}" if new_policy is not None
                                                else "none"))
    if size is None and age is None:
        size, _ = hygiene.policy_max_size(cache)
        if size is None and set_max is None:
            raise click.UsageError("give --max-size SIZE and/or --older-than DURATION, or keep a policy with "
                                   "`musekern gc --set-max-size 2G`, e.g. `musekern gc --max-size 2G`")
    skipped: list[str] = []
    doomed = [] if size is None and age is None else hygiene.gc(cache, max_size=size, older_than=age,
                                                                now=time.time(), dry_run=dry_run, skipped=skipped)
    for line in skipped:
        log(f"musekern: warning: {line}")
    after = hygiene.stats(cache)
    if dry_run:  # nothing was removed: report what would be left
        after = {**after, "entries": after["entries"] - len(doomed),
                 "bytes": after["bytes"] - sum(e.size_bytes for e in doomed)}
    if as_json:
        emit_json({"cache_dir": str(cache.root), "dry_run": dry_run, "max_size": size,
                   "removed": [e.summary() for e in doomed], "entries_left": after["entries"],
                   "bytes_left": after["bytes"], "skipped": skipped})
        return
    for e in doomed:
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.key[:16]} {e.label}")
    click.echo(f"{len(doomed)} entries {'would be ' if dry_run else ''}removed; {after['entries']} entries, "
               f"{_human(after['bytes'])} left ({cache.root})")


# ---------------------------------------------------------------- explain
def _planned_parts(plan, shard=None):
    """(model, targets, [(PlanEntry, KeyParts)]) of the plan's entries, or of its shard (K, N): the variants
    `prepare --shard K/N` of the same plan builds (variants.shard_plan), keyed as prepare keys them."""
    from ..builder.prepare import plan_keys
    from ..plan import plan_model, shard_plan

    model, targets = plan.load()
    entries = plan_model(model, targets)
    if shard:
        entries = shard_plan(entries, *shard)
    return model, targets, list(zip(entries, plan_keys(entries), strict=True))


def _parts_json(entry) -> dict:
    return {"key": entry.key, "path": str(entry.path), "label": entry.label, "parts": entry.manifest.get("key_parts")}


@click.command("explain")
@click.argument("what", metavar="LABEL_OR_KEY")
@plan_options
@cache_dir_option
@json_option
def explain_cmd(what, plan, cache_dir, as_json):
    """Print the key parts of an entry (key or key prefix) or of a variant label.

    For a label, the matching entries are shown; with --model/--target the planned key is
    computed too, and when it is missing the nearest entry and the parts that differ are named.
    """
    from ..store.cache import CacheError
    from ..store.keys import is_key

    cache = _open(cache_dir)
    w = what.strip().lower()
    result: dict = {"cache_dir": str(cache.root), "query": what}
    if re.fullmatch(f"[0-9a-f]{{1,{MIN_KEY_PREFIX - 1}}}", w):  # no label is hex digits only
        n = sum(k.startswith(w) for k in cache.entry_keys())
        raise UsageFailure(f"key prefix {what!r} is too short: give at least {MIN_KEY_PREFIX} hex digits of the key "
                           f"({n} entr{'y starts' if n == 1 else 'ies start'} with it; `musekern ls{_cd(cache)}` "
                           "shows 16)")
    if re.fullmatch(f"[0-9a-f]{{{MIN_KEY_PREFIX},64}}", w):
        matches = [k for k in cache.entry_keys() if k.startswith(w)]
        if len(matches) > 1:
            raise UsageFailure(f"key prefix {what!r} is ambiguous: {len(matches)} entries start with it; give more "
                               f"digits (`musekern ls{_cd(cache)}` shows 16)")
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
    if plan.given():
        model, _, pairs = _planned_parts(plan)
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
            log(f"fix: musekern prepare{plan.flags(targets=[p['target']])}{_cd(cache)}")


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
@plan_options
@shard_option
@click.option("--all", "all_", is_flag=True, help="Export every sound entry instead of a model's plan (a damaged one "
              "is skipped with a warning, and the export exits 1).")
@click.option("--key", "keys", multiple=True, help="Export this entry (repeatable) instead of a model's plan.")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Bundle to write: NAME.tar, or NAME.tar.gz / NAME.tgz (gzip).")
@sign_key_option
@cache_dir_option
@json_option
def export_cmd(plan, shard, all_, keys, output, sign_key, cache_dir, as_json):
    """Write a reproducible bundle (tar) of the model's planned entries, or of shard K/N of them (what
    `prepare --shard K/N` built), or --all / --key entries; --sign-key signs each manifest in it."""
    from ..store.bundle import bundle_compression, export_bundle
    from ..store.cache import CacheError
    from ..store.signing import SecretKey

    bundle_compression(output)  # a name export does not write (x.zip) is refused before any work
    sign = SecretKey.from_env(sign_key)
    cache = _open(cache_dir)
    plan_name = None
    warnings: list[str] = []
    skipped: list[str] = []
    if all_ or keys:
        if plan.given() or shard:
            raise click.UsageError("give either --model/--target/--tp/--kv-cache-dtype/--weight-format/--shard or "
                                   "--all/--key, not both")
        chosen = []
        for k in cache.entry_keys() if all_ else []:
            insp = cache.inspect(k)
            if insp.status == "sound":
                chosen.append(k)
            elif insp.status == "bad":
                skipped.append(k)
                warn(f"skipping damaged entry {k[:16]}: {'; '.join(insp.problems)[:300]}")
        for k in keys:
            matches = [x for x in cache.entry_keys() if x.startswith(k.lower())]
            if len(matches) != 1:
                raise Failure(f"--key {k}: {'no' if not matches else 'more than one'} matching entry in "
                              f"{cache.root}; `musekern ls{_cd(cache)}` lists them")
            chosen.append(matches[0])
    else:
        model, targets, pairs = _planned_parts(plan, shard)
        warnings = list(model.warnings)
        policy = lookup.Policy.build(verify=False)
        chosen, missing = [], []
        for pe, parts in pairs:
            hit = lookup.find(cache, parts, policy)
            (chosen.append(hit.key) if hit else missing.append(pe))
        sh = f" --shard {shard[0]}/{shard[1]}" if shard else ""
        what = f"shard {shard[0]}/{shard[1]} of the plan" if shard else "the plan"
        if missing:
            for pe in missing:
                log(f"missing: {pe.target.name} {pe.variant.label}")
            raise Failure(f"{len(missing)} of the {len(pairs)} variants of {what} are not in {cache.root}; "
                          f"run `musekern prepare{plan.flags(targets=[t.name for t in targets])}{sh}{_cd(cache)}` "
                          "first")
        # A shard's bundle records its own plan name: importing every shard into one cache then records every
        # shard's keys (one shared name would keep only the last import's, and `clean --stale` would drop the rest).
        plan_name = plan.record_name(model, targets) + (f"|shard {shard[0]}/{shard[1]}" if shard else "")
    try:
        index = export_bundle(cache, chosen, output, plan_name=plan_name, sign=sign)
    except CacheError as e:
        raise Failure(str(e)) from None
    except OSError as e:
        raise Failure(f"cannot write {output}: {e.strerror or e}") from None
    n = len(index["entries"])
    if as_json:
        emit_json({"cache_dir": str(cache.root), "output": str(output), "entries": n, "ok": not skipped,
                   "keys": [x["key"] for x in index["entries"]], "plan": plan_name, "signed_by": sign and sign.name,
                   "skipped": skipped, "warnings": warnings})
    else:
        click.echo(f"exported {n} entries to {output}" + (f", signed by {sign.name}" if sign else "")
                   + (f"; {len(skipped)} damaged entries skipped" if skipped else ""))
    if skipped:
        log(f"musekern: error: {len(skipped)} damaged entr{'y was' if len(skipped) == 1 else 'ies were'} not "
            f"exported; `musekern verify{_cd(cache)}` says why, `musekern verify --repair{_cd(cache)}` then "
            f"`musekern prepare{_cd(cache)}` rebuilds them")
        raise SystemExit(EXIT_FAIL)


@click.command("import")
@click.argument("bundle")
@trusted_keys_option
@cache_dir_option
@json_option
def import_cmd(bundle, trusted_keys, cache_dir, as_json):
    """Verify a bundle and add its entries to the cache (bad entries, and with trusted keys unsigned or
    untrusted ones, are rejected, exit 1)."""
    from ..store.bundle import import_bundle
    from ..store.signing import TrustedKeys

    trusted = TrustedKeys.from_env(trusted_keys)
    cache = _open(cache_dir)
    report = import_bundle(cache, bundle, trusted)  # BundleError, ReadOnlyCacheError: one line each (register)
    if as_json:
        emit_json({"cache_dir": str(cache.root), "bundle": str(bundle), **report.to_json()})
    else:
        for key, reason in report.rejected:
            click.echo(f"REJECTED {key[:16]}: {reason}")
        for key, reason in report.failed:
            click.echo(f"FAILED {key[:16]}: {reason}")
        click.echo(f"{len(report.added)} added, {len(report.present)} already present, "
                   f"{len(report.rejected)} rejected, {len(report.failed)} not stored ({cache.root})")
    if report.rejected:
        log(f"musekern: error: {len(report.rejected)} bundle entries failed verification and were not imported; "
            "re-export the bundle from a verified cache (`musekern verify` there, then `musekern export`)")
    if report.failed:
        log(f"musekern: error: {len(report.failed)} entries could not be stored in {cache.root} (see FAILED); "
            f"fix that, then run `musekern import {bundle}{_cd(cache)}` again")
    if not report.ok:
        raise SystemExit(EXIT_FAIL)


COMMANDS = (ls_cmd, verify_cmd, clean_cmd, stats_cmd, gc_cmd, explain_cmd, export_cmd, import_cmd)


def register(group: click.Group) -> None:
    """Add the cache commands to `group` (the `musekern` console script), each with the store's errors mapped
    to one error line."""
    for cmd in COMMANDS:
        if not getattr(cmd.callback, "_one_line_errors", False):
            cmd.callback = one_line_errors(cmd.callback)
            cmd.callback._one_line_errors = True
        group.add_command(cmd)
