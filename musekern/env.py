"""Every MUSEKERN_* environment variable, in one table, and one way to read a flag.

Pure stdlib (the runtime and the CLI both read it). `musekern --help` and `musekern doctor` list the table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str


CACHE_DIR = Variable("MUSEKERN_CACHE_DIR", "", "cache directory (unset: the user cache dir; --cache-dir wins)")
REMOTE = Variable("MUSEKERN_REMOTE", "", "HTTP cache (Bazel protocol) prepare pulls from (--remote wins)")
REMOTE_TIMEOUT = Variable("MUSEKERN_REMOTE_TIMEOUT", "10", "seconds per remote request")
AUTOBUILD = Variable("MUSEKERN_AUTOBUILD", "0", "compile a variant missing at run time (needs the build extra)")
CTYPES_LAUNCH = Variable("MUSEKERN_CTYPES_LAUNCH", "1", "launch through libcuda via ctypes (0: cuda.bindings)")
VARIABLES = (CACHE_DIR, REMOTE, REMOTE_TIMEOUT, AUTOBUILD, CTYPES_LAUNCH)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A MUSEKERN_* variable holds a value that cannot be read; the message names it and the fix."""


def value(var: Variable) -> tuple[str, str]:
    """(value, source): the variable's value and "env", or its default and "default"."""
    raw = os.environ.get(var.name)
    return (raw, "env") if raw is not None else (var.default, "default")


def flag(var: Variable) -> bool:
    """A boolean variable: true/false/1/0/yes/no/on/off, case- and space-insensitive; unset or empty is the
    default; anything else raises EnvError naming the variable."""
    raw = os.environ.get(var.name, "").strip().lower() or var.default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise EnvError(f"{var.name}={os.environ.get(var.name)!r} is not a boolean: set it to 1 or 0 "
                   f"(true/false, yes/no, on/off), or unset it")
