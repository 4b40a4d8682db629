"""The `musekern` console script: prepare, plan, doctor, and the cache commands (cache_cmds.py).

Results go to stdout (`--json` everywhere), logs and errors to stderr; exit 0 ok, 1 failure, 2 usage.
"""
from __future__ import annotations

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="musekern")
def main():
    """Ahead-of-time CuTe DSL kernel builds and a cubin cache for the Muse Spark attention front."""


def _register_all():
    from . import bench_cmd, build_cmds, cache_cmds, doctor_cmd

    for module in (build_cmds, cache_cmds, doctor_cmd, bench_cmd):
        module.register(main)


_register_all()

__all__ = ["main"]
