"""Options and output helpers shared by every musekern command (defined once, here)."""
from __future__ import annotations

import dataclasses
import errno
import functools
import json
import re
import shlex
import sys

import click

from .. import kv_cache
from ..config import ConfigError, load_config, with_kv_cache_dtype, with_tensor_parallel, with_weight_format
from ..targets import TargetError, check_supported, get_target, local_target, supported_targets
from ..weights import formats as weight_formats

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2  # the exit codes of every command

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
cache_dir_option = click.option(
    "--cache-dir", type=click.Path(file_okay=False), default=None,
    help="Cache directory (default: $MUSEKERN_CACHE_DIR, else the user cache dir).")
model_option = click.option(  # a plain path: the config reader refuses a directory, FIFO or device in one line
    "--model", "model_path", type=click.Path(), metavar="FILE", default=None,
    help="Model config: your model's config.json as published (text_config, head_dim null, dtype are read), "
         "optionally with a `musekern` block. Default: the bundled Muse Spark config.")
sign_key_option = click.option(
    "--sign-key", "sign_key", default=None, metavar="FILE",
    help="Sign the entries' manifests with this secret key file (`musekern keys generate`) [env: MUSEKERN_SIGN_KEY].")
trusted_keys_option = click.option(
    "--trusted-keys", "trusted_keys", default=None, metavar="KEYS",
    help="Take entries from a remote or a bundle only when signed by one of these public keys (NAME:base64, or "
         "files of them; space-separated) [env: MUSEKERN_TRUSTED_KEYS]. Local builds are trusted.")
target_option = click.option(
    "--target", "target_names", multiple=True,
    help=f"GPU target (repeatable): {supported_targets()}. Default: the config's `targets`, else the local GPU.")


def _parse_tp(ctx, param, value):
    if value is None:
        return None
    try:
        tps = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated sizes such as 1,2,4,8, got {value!r}") from None
    if not tps:
        raise click.BadParameter(f"expected comma-separated sizes such as 1,2,4,8, got {value!r}")
    return tps


tp_option = click.option(
    "--tp", "tp", default=None, metavar="1,2,4,8", callback=_parse_tp,
    help="Tensor-parallel sizes to plan (overrides the config's musekern.tensor_parallel_sizes; a config that "
         "names none plans TP 1 and warns).")


def _checked(parse):
    """A click callback: None (not given) stays None, else parse(value), whose ValueError is the usage error."""
    def callback(ctx, param, value):
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return callback


kv_cache_dtype_option = click.option(
    "--kv-cache-dtype", "kv_cache_dtype", default=None, metavar="{" + ",".join(kv_cache.CHOICES) + "}",
    callback=_checked(kv_cache.resolve),
    help="The KV cache the engine allocates, as vLLM's --kv-cache-dtype: auto / bf16 plan the builds that write "
         "bf16 caches, fp8 / fp8_e4m3 those that write e4m3 with per-tensor k_scale / v_scale (fp8_e5m2 is not "
         "served). Overrides the config's musekern.kv_cache_dtype.")


def _weight_format_spelling(value: str) -> str:
    """The --weight-format value as given (lower case), once weights.formats.parse_override takes it."""
    weight_formats.parse_override(value)
    return value.strip().lower()


weight_format_option = click.option(
    "--weight-format", "weight_format", default=None, metavar="{" + ",".join(weight_formats.OVERRIDE_CHOICES) + "}",
    callback=_checked(_weight_format_spelling),
    help="The checkpoint's weight format, instead of what the config's quantization_config says (auto): bf16, or "
         "e4m3 weights with 128x128 block (ue8m0: power-of-two), per-channel or per-tensor scales; FP8 formats plan "
         "the FP8-weight front builds (M <= 16, the GEMM path above).")


def parse_shard(value):
    """'K/N' -> (K, N), the shard of variants.shard_plan; a usage error otherwise."""
    if value is None:
        return None
    try:
        k, n = (int(x) for x in value.split("/"))
        if n < 1 or not 1 <= k <= n:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"expected K/N with 1 <= K <= N, got {value!r}", param_hint="--shard") from None
    return k, n


shard_option = click.option(
    "--shard", "shard", default=None, metavar="K/N", callback=lambda ctx, p, v: parse_shard(v),
    help="Only shard K of N of the plan (a deterministic round robin over the sorted plan: `prepare --shard K/N` "
         "and `export --shard K/N` of one plan name the same variants).")


class Failure(click.ClickException):
    """A command failed (exit 1): the message says what is wrong and the command that fixes it."""
    exit_code = EXIT_FAIL

    def show(self, file=None):
        click.echo(f"musekern: error: {self.format_message()}", err=True)


class UsageFailure(click.UsageError):
    """Bad input (config, target, variant label): exit 2 with a message that says how to fix it."""
    exit_code = EXIT_USAGE

    def show(self, file=None):
        click.echo(f"musekern: error: {self.format_message()}", err=True)


def one_line_errors(callback):
    """`callback` with the errors no command expects as `musekern: error: <one line>`, exit 1: the store's
    (CacheError), the environment's (EnvError) and any OSError (the path, the reason, the fix: store.fs.describe).
    The `musekern` group wraps every command with it; a broken stdout pipe stays what it is."""
    @functools.wraps(callback)
    def run(*args, **kwargs):
        from ..env import EnvError
        from ..store import fs
        from ..store.cache import CacheError

        try:
            return callback(*args, **kwargs)
        except (CacheError, EnvError) as e:
            raise Failure(str(e)) from None
        except OSError as e:
            if is_broken_pipe(e):
                raise
            raise Failure(fs.describe(e, e.filename or "?")) from None
    return run


def is_broken_pipe(e: OSError) -> bool:
    return e.errno == errno.EPIPE


def load_model(path, tp=None, kv_cache_dtype=None, weight_format=None):
    """The validated config (with --tp, --kv-cache-dtype and --weight-format applied); its warnings go to stderr
    here, and every --json result that plans carries them too (`model.warnings`)."""
    try:
        model = load_config(path)
        if tp is not None:
            model = with_tensor_parallel(model, tp)
        if kv_cache_dtype is not None:
            model = with_kv_cache_dtype(model, kv_cache_dtype)
        if weight_format is not None:
            model = with_weight_format(model, weight_format)
    except ConfigError as e:
        raise UsageFailure(str(e)) from None
    for w in model.warnings:
        warn(w)
    return model


def resolve_targets(names, model):
    """--target names > the config's `targets` > the local GPU; each must be one musekern builds for.

    A local GPU that no kernel supports (an A100) is refused with the supported targets, never planned."""
    try:
        if names:
            return [get_target(n) for n in dict.fromkeys(names)]
        if model is not None and model.targets:
            return [get_target(n) for n in model.targets]
        local = local_target()
        if local is not None:
            try:
                return [check_supported(local)]
            except TargetError as e:
                raise UsageFailure(f"the local GPU: {e}; pass one with --target") from None
    except TargetError as e:
        raise UsageFailure(str(e)) from None
    raise UsageFailure("no target: none named (--target), none in the config (musekern.targets), no GPU here; "
                       f"pass one, e.g. `musekern prepare --target h200` (supported: {supported_targets()})")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The options that say what to plan, as given (None / () where not: the config's values then): --model,
    --target, --tp, --kv-cache-dtype, --weight-format. `plan_options` hands them to a command as one."""
    model_path: str | None = None
    target_names: tuple[str, ...] = ()
    tp: tuple[int, ...] | None = None
    kv_cache_dtype: str | None = None
    weight_format: str | None = None

    def given(self) -> bool:
        return bool(self.model_path or self.target_names or self.tp or self.kv_cache_dtype or self.weight_format)

    def load(self):
        """(model, targets): the validated config with the options applied (`load_model`: its warnings on stderr)
        and the targets (`resolve_targets`)."""
        model = load_model(self.model_path, self.tp, self.kv_cache_dtype, self.weight_format)
        return model, resolve_targets(self.target_names, model)

    def flags(self, targets=None) -> str:
        """The options as a suggested command spells them, shell-quoted (`targets`: these target names in place of
        --target's); none for an option not given."""
        given = [("--model", self.model_path), *(("--target", t) for t in (self.target_names if targets is None
                                                                          else targets)),
                 ("--tp", ",".join(map(str, self.tp)) if self.tp else None),
                 ("--kv-cache-dtype", self.kv_cache_dtype), ("--weight-format", self.weight_format)]
        return "".join(f" {flag} {shlex.quote(str(value))}" for flag, value in given if value)

    def record_name(self, model, targets) -> str:
        """The name `prepare` records the plan's keys under (`clean --stale` keeps the entries of every recorded
        plan; a new record of a name replaces the old one): the config and the targets, then each planning option
        given, as resolved. Two plans of one config (--tp 8 and --tp 1, bf16 and FP8 weights) keep two records."""
        name = f"{model.source}|{','.join(t.name for t in targets)}"
        if self.tp:
            name += "|tp " + ",".join(map(str, model.tensor_parallel_sizes))
        if self.kv_cache_dtype:
            name += f"|kv {model.kv_cache_dtype}"
        if self.weight_format:
            name += f"|weights {model.weight_format.name}"
        return name


def plan_options(command):
    """--model, --target, --tp, --kv-cache-dtype and --weight-format (defined once, above), handed to `command` as
    one argument `plan` (a PlanOptions)."""
    @functools.wraps(command)
    def run(*args, model_path, target_names, tp, kv_cache_dtype, weight_format, **kwargs):
        return command(*args, plan=PlanOptions(model_path, tuple(target_names), tp, kv_cache_dtype, weight_format),
                       **kwargs)
    for option in (weight_format_option, kv_cache_dtype_option, tp_option, target_option, model_option):
        run = option(run)  # (click lists the last applied first: --model, --target, --tp, ...)
    return run


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def log(msg: str) -> None:
    """Progress, warnings, errors and fix hints go to stderr; results (tables, JSON, summaries) to stdout."""
    click.echo(msg, err=True)


def warn(msg: str) -> None:
    log(f"musekern: warning: {msg}")


TABLE_WIDTH = 120  # columns every table fits by default (CI logs, a laptop terminal); --wide: no limit
_MIN_WRAP = 12  # a wrapped column keeps at least this many columns (or its header's width)
_BREAKS = re.compile(r"(?<=[,\s\]|/])|(?=\[)")  # a long label breaks after , ] | / or a space, or before [


def _set_wide(ctx, param, value):
    if value:
        ctx.meta["musekern.wide"] = True


wide_option = click.option("--wide", is_flag=True, expose_value=False, callback=_set_wide, is_eager=True,
                           help=f"Print tables at full width, one line a row (default: they fit {TABLE_WIDTH} "
                                "columns, long cells wrapped; --json has every field).")


def _table_width() -> int | None:
    ctx = click.get_current_context(silent=True)
    return None if ctx is not None and ctx.meta.get("musekern.wide") else TABLE_WIDTH


def _wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width`, broken where a label reads well (after a comma, before a bracket)."""
    lines, cur = [], ""
    for piece in (p for p in _BREAKS.split(text) if p):
        while len(piece) > width:  # a piece longer than the column: cut it
            if cur:
                lines.append(cur.rstrip())
                cur = ""
            lines.append(piece[:width])
            piece = piece[width:]
        if len(cur) + len(piece) > width and cur:
            lines.append(cur.rstrip())
            cur = ""
        cur += piece.lstrip() if not cur else piece
    return lines + [cur.rstrip()] if cur or not lines else lines


def table(rows: list[list], headers: list[str], width: int | None = 0) -> str:
    """Rows under headers, columns two spaces apart, fitting `width` columns (default TABLE_WIDTH, None: no limit,
    as `--wide` asks): the widest columns are narrowed to one cap and their cells wrapped onto more lines."""
    width = _table_width() if width == 0 else width
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    room = None if width is None else width - 2 * (len(widths) - 1)
    if room is not None and sum(widths) > room:
        cap = max(widths)
        floors = [max(_MIN_WRAP, len(h)) for h in cells[0]]
        while cap > 1 and sum(min(w, max(cap, f)) for w, f in zip(widths, floors, strict=True)) > room:
            cap -= 1
        widths = [min(w, max(cap, f)) for w, f in zip(widths, floors, strict=True)]
    out = []
    for r in [cells[0], ["-" * w for w in widths], *cells[1:]]:
        parts = [_wrap(c, w) if len(c) > w else [c] for c, w in zip(r, widths, strict=True)]
        for i in range(max(len(p) for p in parts)):
            out.append("  ".join((p[i] if i < len(p) else "").ljust(w)
                                 for p, w in zip(parts, widths, strict=True)).rstrip())
    return "\n".join(out)


class Progress:
    """Progress of `length` items on stderr: a bar on a terminal; elsewhere (CI logs, a pipe) one line per finished
    item, `[i/length] <line(item)>`, so a long run shows its progress as it goes (the bar shows `show(item)`, default
    `line(item)`). Call it with each finished item."""

    def __init__(self, length: int, label: str, line, show=None, file=None):
        self.length, self.line, self.done = length, line, 0
        self.file = file if file is not None else sys.stderr
        self.bar = None
        if self.file.isatty():
            self.bar = click.progressbar(length=length, label=label, file=self.file, show_pos=True,
                                         item_show_func=lambda item: (show or line)(item) if item else None)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def __call__(self, item) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1, item)
        else:
            click.echo(f"[{self.done}/{self.length}] {self.line(item)}", file=self.file)


def environment() -> list[dict]:
    """Every MUSEKERN_* variable: name, value as it may be shown (credentials masked, env.shown), source ("env" or
    "default") and meaning (musekern/env.py)."""
    from .. import env

    out = []
    for var in env.VARIABLES:
        value, source = env.shown(var)
        out.append({"name": var.name, "value": value, "source": source, "meaning": var.meaning})
    return out

