"""Options and output helpers shared by every musekern command (defined once, here)."""
from __future__ import annotations

import json

import click

from ..config import ConfigError, load_config
from ..targets import UnknownTargetError, get_target, local_target

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2  # the exit codes of every command

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
cache_dir_option = click.option(
    "--cache-dir", type=click.Path(file_okay=False), default=None,
    help="Cache directory (default: $MUSEKERN_CACHE_DIR, else the user cache dir).")
model_option = click.option(
    "--model", "model_path", type=click.Path(dir_okay=False), default=None,
    help="Model config (cfg.json); default: the bundled Muse Spark config.")
target_option = click.option(
    "--target", "target_names", multiple=True,
    help="GPU target (repeatable): h100, h200, h100-pcie, h20, b200. Default: the local GPU, "
         "else the config's targets.")


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


def load_model(path):
    try:
        return load_config(path)
    except ConfigError as e:
        raise UsageFailure(str(e)) from None


def resolve_targets(names, model):
    """--target names > the local GPU > the config's targets; else a usage error that says what to pass."""
    try:
        if names:
            return [get_target(n) for n in dict.fromkeys(names)]
    except UnknownTargetError as e:
        raise UsageFailure(str(e)) from None
    local = local_target()
    if local is not None:
        return [local]
    if model is not None and model.targets:
        return [get_target(n) for n in model.targets]
    raise UsageFailure("no GPU here and no target named: pass one, e.g. `musekern prepare --target h200`")


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def log(msg: str) -> None:
    """Progress and diagnostics go to stderr; results go to stdout."""
    click.echo(msg, err=True)


def table(rows: list[list], headers: list[str]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])

