"""The `musekern` console script: prepare, plan, doctor, and the cache commands (cache_cmds.py).

Results go to stdout (`--json` everywhere), logs and errors to stderr; exit 0 ok, 1 failure, 2 usage.
"""
from __future__ import annotations

import sys

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="musekern")
def main():
    """Ahead-of-time CuTe DSL kernel builds and a cubin cache for the Muse Spark attention front."""


def _register_all():
    from . import bench_cmd, build_cmds, doctor_cmd

    build_cmds.register(main)
    doctor_cmd.register(main)
    bench_cmd.register(main)
    try:
        from . import cache_cmds
    except ImportError as e:  # pragma: no cover - only while the module is being written
        print(f"musekern: cache commands unavailable: {e}", file=sys.stderr)
    else:
        cache_cmds.register(main)


_register_all()

__all__ = ["main"]
