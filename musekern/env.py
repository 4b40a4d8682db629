"""Every MUSEKERN_* environment variable, in one table, and one way to read each kind (flag, seconds, size).

Pure stdlib (the runtime and the CLI both read it). `musekern --help` and `musekern doctor` list the table.
A value that cannot be read raises EnvError naming the variable and what to set it to; unset or empty is the
default.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str
    kind: str = "text"  # how its value is shown (`shown`): "text" as it is, "url" masked, "secret" never


CACHE_DIR = Variable("MUSEKERN_CACHE_DIR", "", "cache directory (unset: the user cache dir; --cache-dir wins)")
REMOTE = Variable("MUSEKERN_REMOTE", "", "HTTP cache (Bazel protocol) prepare pulls from (--remote wins); "
                  "http://user:password@host/ sends Basic auth", kind="url")
REMOTE_TOKEN = Variable("MUSEKERN_REMOTE_TOKEN", "", "token sent to the remote as `Authorization: Bearer <token>` "
                        "(instead of a user:password in the URL)", kind="secret")
REMOTE_TIMEOUT = Variable("MUSEKERN_REMOTE_TIMEOUT", "10",
                          "seconds one remote request may take, from connect to its last byte")
REMOTE_DEADLINE = Variable("MUSEKERN_REMOTE_DEADLINE", "120",
                           "seconds one prepare may spend on the remote in all; then it goes on without it")
MAX_SIZE = Variable("MUSEKERN_MAX_SIZE", "",
                    "cache size policy (e.g. 2G): prepare and a plain `musekern gc` trim to it (wins over "
                    "`gc --set-max-size`)")
AUTOBUILD = Variable("MUSEKERN_AUTOBUILD", "0", "compile a variant missing at run time (needs the build extra)")
CTYPES_LAUNCH = Variable("MUSEKERN_CTYPES_LAUNCH", "1", "launch through libcuda via ctypes (0: cuda.bindings)")
SIGN_KEY = Variable("MUSEKERN_SIGN_KEY", "", "secret key file prepare and export sign entries with (--sign-key wins)")
TRUSTED_KEYS = Variable("MUSEKERN_TRUSTED_KEYS", "",
                        "public keys (NAME:base64, or files of them) whose signature an entry from a remote or a "
                        "bundle needs (unset: none asked; --trusted-keys wins)")
VARIABLES = (CACHE_DIR, REMOTE, REMOTE_TOKEN, REMOTE_TIMEOUT, REMOTE_DEADLINE, MAX_SIZE, AUTOBUILD, CTYPES_LAUNCH,
             SIGN_KEY, TRUSTED_KEYS)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_SIZE_BYTES = 2**63 - 1
MAX_SECONDS = 7 * 86400.0


class EnvError(ValueError):
    """A MUSEKERN_* variable holds a value that cannot be read; the message names it and the fix."""


def value(var: Variable) -> tuple[str, str]:
    """(value, source): the variable's value and "env", or its default and "default"."""
    raw = os.environ.get(var.name)
    return (raw, "env") if raw is not None else (var.default, "default")


def shown(var: Variable) -> tuple[str, str]:
    """(value, source) fit to print (doctor, logs, --json): a URL with its credentials masked (`mask_url`), a
    secret as "(set, not shown)"."""
    raw, source = value(var)
    if var.kind == "secret":
        return ("(set, not shown)" if raw.strip() else raw), source
    return (mask_url(raw) if var.kind == "url" else raw), source


def mask_url(url: str) -> str:
    """`url` fit to print, its credentials replaced by ***: the one masking of a remote URL, wherever one is shown.

    Everything between `//` (or the start) and the LAST `@` is userinfo, so a password holding an unencoded / ? #
    or @ is masked whole (a path or query with an @ is masked too: better too much than a leak). A user name is
    kept when a password follows it, else it is taken for a token (pip's rule); every query value is ***."""
    s = str(url)
    start = s.find("//") + 2 if "//" in s else 0
    at = s.rfind("@")
    if at >= start:
        user, colon, _ = s[start:at].partition(":")
        s = s[:start] + (f"{user}:***" if colon and user and not re.search(r"[/?#]", user) else "***") + s[at:]
    head, q, query = s.partition("?")
    if q:
        query, hash_, frag = query.partition("#")
        query = "&".join(f"{k}=***" if eq else "***" for k, eq, _ in (p.partition("=") for p in query.split("&")))
        s = head + q + query + hash_ + frag
    return s


def _raw(var: Variable) -> str:
    return os.environ.get(var.name, "").strip() or var.default


def flag(var: Variable) -> bool:
    """A boolean variable: true/false/1/0/yes/no/on/off, case- and space-insensitive; unset or empty is the
    default; anything else raises EnvError naming the variable."""
    raw = _raw(var).lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise EnvError(f"{var.name}={os.environ.get(var.name)!r} is not a boolean: set it to 1 or 0 "
                   f"(true/false, yes/no, on/off), or unset it")


def parse_seconds(text: str) -> float:
    """'10', '2.5' -> seconds: a finite number above 0 and at most a week; ValueError otherwise."""
    try:
        x = float(text.strip())
    except (ValueError, AttributeError):
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(x) or not 0 < x <= MAX_SECONDS:
        raise ValueError(f"{text!r} seconds is out of range (0, {MAX_SECONDS:g}]")
    return x


def seconds(var: Variable) -> float:
    """A duration variable (seconds > 0, finite); raises EnvError naming the variable."""
    raw = _raw(var)
    try:
        return parse_seconds(raw)
    except ValueError as e:
        raise EnvError(f"{var.name}={os.environ.get(var.name)!r}: {e}; set it to a number of seconds such as "
                       f"{var.default}, or unset it") from None


def parse_size(text: str) -> int:
    """'500M', '2GiB', '1.5g', '1048576' -> bytes (k/M/G are powers of 10, KiB/MiB/GiB of 2). ValueError for
    anything else or more than 2**63 - 1 bytes (never an OverflowError)."""
    m = re.fullmatch(r"\s*(\d{1,30})(?:\.(\d{1,30}))?\s*([A-Za-z]*)\s*", text or "")
    unit = m and m.group(3).lower()
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {str(text)[:40]!r} (e.g. 500M, 2G, 1GiB, 1048576)")
    frac = m.group(2) or ""
    n = (int(m.group(1) + frac) * _SIZE_UNITS[unit]) // 10 ** len(frac)  # exact: no float rounding or overflow
    if n > MAX_SIZE_BYTES:
        raise ValueError(f"size {str(text)[:40]!r} is larger than {MAX_SIZE_BYTES} bytes")
    return n


def human_size(n: int) -> str:
    """1536 -> '1.5 KiB': how every command shows a size (powers of 2)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def size(var: Variable) -> int | None:
    """A size variable (None when unset or empty); raises EnvError naming the variable."""
    raw = _raw(var)
    if not raw:
        return None
    try:
        return parse_size(raw)
    except ValueError as e:
        raise EnvError(f"{var.name}={os.environ.get(var.name)!r}: {e}; set it to a size such as 2G, or unset "
                       "it") from None
