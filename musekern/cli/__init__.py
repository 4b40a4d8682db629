"""The `musekern` console script: prepare, plan, doctor, and the cache commands (cache_cmds.py).

Where output goes, in every command:

- stdout carries the result: the table or records the command was asked for and the one summary line
  that states the outcome ("16 built, ...", "4 entries checked, 0 bad", "0 entries in DIR"); with
  `--json`, exactly one JSON document and nothing else (warnings are in it too).
- stderr carries everything said on the way: the line announcing the work, progress bars, warnings
  (`musekern: warning: ...`), errors (`musekern: error: ...`, one line each) and the fix commands.

Exit codes: 0 ok, 1 failure (the message names what is wrong and the command that fixes it), 2 usage
(bad option, config, target or label). An OSError no command expected (a cache dir under /proc, a
directory it may not read) is one error line naming the path, exit 1, never a traceback.
"""
from __future__ import annotations

import click

from .. import __version__
from .common import one_line_errors


def _epilog() -> str:
    from ..env import VARIABLES

    width = max(len(v.name) for v in VARIABLES)
    lines = [f"  {v.name:<{width}}  {v.meaning}" + (f" [default: {v.default}]" if v.default else "")
             for v in VARIABLES]
    # \b keeps click from re-wrapping the list
    return "\b\nEnvironment (`musekern doctor` shows each value and where it came from):\n" + "\n".join(lines)


class _Main(click.Group):
    def invoke(self, ctx):
        return one_line_errors(super().invoke)(ctx)  # the store's, the environment's and OS errors: one line


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]}, epilog=_epilog())
@click.version_option(__version__, prog_name="musekern")
def main():
    """Ahead-of-time CuTe DSL kernel builds and a cubin cache for the Muse Spark attention front."""


def _register_all():
    from . import bench_cmd, build_cmds, cache_cmds, doctor_cmd, keys_cmd

    for module in (build_cmds, cache_cmds, keys_cmd, doctor_cmd, bench_cmd):
        module.register(main)


_register_all()

__all__ = ["main"]
