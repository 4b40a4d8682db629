"""GEMM tuning records: what `ops.gemm.tune` measured, kept in the cache so the next process skips the timing.

One file per (GPU, cuBLASLt version) scope, `<cache>/v2/tuning/<scope>.json`: for each (N, M) the candidate kept
("mm" is torch.mm), its algorithm's 64 opaque bytes and workspace, and every candidate's measured us. A GPU model
and a cuBLASLt build give the same speeds wherever they meet; another GPU, driver-visible SM count or cuBLASLt
version is another scope, so nothing is ever reused across them.

Trust: a record is advice, never authority. The reader (`load`) is bounded (MAX_BYTES, strict field types and
ranges; a bad shape is skipped, a bad file reads as empty, nothing raises), and the product uses a recorded
algorithm only when cuBLASLt offers those exact bytes for that shape now and its result matches torch.mm's
(ops/gemm.py), re-deciding the pick from the recorded times with its own rule. So a corrupt, stale or crafted file
can cost speed (a slower algorithm), never a wrong result, a crash or a hang; `musekern clean --all` removes the
records. Writers (`save`) merge into the file under a lock (tuning.lock) and replace it atomically; a cache that is
read-only, missing or full keeps no record, and the tuning still holds for the process. Stdlib only.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import locks
from .cache import Cache
from .fs import ReadProblem, atomic_write, describe, read_regular
from .manifest import manifest_bytes, parse_json

FORMAT = 1
MAX_BYTES = 4 << 20  # a file this size holds ~4000 shapes with every candidate's time; larger is not ours
MAX_SHAPES = 8192
MAX_CANDIDATES = 64
ALGO_BYTES = 64  # cublasLtMatmulAlgo_t
MAX_WORKSPACE = 1 << 31
MAX_DIM = 1 << 24
_NAME = re.compile(r"[A-Za-z0-9_.,=\[\]-]{1,100}")


@dataclass(frozen=True)
class Record:
    """One shape's measurement: the candidate kept, its algorithm (None for torch.mm) and workspace, every time."""
    chosen: str
    algo: bytes | None
    workspace: int
    us: dict  # candidate name -> median us a call


def scope(gpu_name: str, capability: tuple, sm_count: int, lib_version: int) -> str:
    """The file stem of one (GPU, cuBLASLt) scope: readable and safe as a file name."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-")[:60] or "gpu"
    return f"{slug}.sm{capability[0]}{capability[1]}.{int(sm_count)}sms.cublaslt{int(lib_version)}"


def tuning_dir(cache: Cache) -> Path:
    return cache.base / "tuning"


def path_of(cache: Cache, scope_name: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9.-]{1,160}", scope_name):
        raise ValueError(f"not a tuning scope: {scope_name!r}")
    return tuning_dir(cache) / f"{scope_name}.json"


def _shape(key: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"([1-9][0-9]{0,7})x([1-9][0-9]{0,7})", key)
    if not m:
        return None
    n, rows = int(m.group(1)), int(m.group(2))
    return (n, rows) if n <= MAX_DIM and rows <= MAX_DIM else None


def _record(v) -> Record | None:
    """A shape's record from its JSON value, or None for anything not exactly ours."""
    if not isinstance(v, dict) or set(v) - {"chosen", "algo", "workspace", "us"}:
        return None
    chosen, us, ws, algo = v.get("chosen"), v.get("us"), v.get("workspace", 0), v.get("algo")
    if not (isinstance(chosen, str) and _NAME.fullmatch(chosen) and isinstance(us, dict)
            and 0 < len(us) <= MAX_CANDIDATES and type(ws) is int and 0 <= ws <= MAX_WORKSPACE):
        return None
    if not all(isinstance(k, str) and _NAME.fullmatch(k) and type(t) in (int, float) and 0 < t < 1e9
               for k, t in us.items()) or chosen not in us:
        return None
    if chosen == "mm":
        return Record(chosen, None, 0, dict(us)) if algo is None and ws == 0 else None
    if not (isinstance(algo, str) and re.fullmatch(f"[0-9a-f]{{{2 * ALGO_BYTES}}}", algo)):
        return None
    return Record(chosen, bytes.fromhex(algo), ws, dict(us))


def load(cache: Cache, scope_name: str) -> dict[tuple[int, int], Record]:
    """(N, M) -> Record of a scope's file: empty when there is none, it cannot be read, or it is not ours; shapes
    whose record is malformed are left out. Never raises."""
    try:
        raw = read_regular(path_of(cache, scope_name), MAX_BYTES)
        d = parse_json(raw, "tuning record")
    except (OSError, ValueError, ReadProblem):
        return {}
    if not isinstance(d, dict) or type(d.get("format")) is not int or d["format"] != FORMAT:
        return {}
    if d.get("scope") != scope_name:
        return {}
    shapes = d.get("shapes")
    if not isinstance(shapes, dict) or len(shapes) > MAX_SHAPES:
        return {}
    out = {}
    for k, v in shapes.items():
        key, rec = _shape(k), _record(v)
        if key is not None and rec is not None:
            out[key] = rec
    return out


def _value(rec: Record) -> dict:
    v = {"chosen": rec.chosen, "us": {k: round(float(t), 3) for k, t in rec.us.items()}}
    if rec.algo is not None:
        v["algo"], v["workspace"] = rec.algo.hex(), int(rec.workspace)
    return v


def save(cache: Cache, scope_name: str, records: dict[tuple[int, int], Record]) -> str | None:
    """Merge `records` into the scope's file (theirs win per shape), under the tuning lock, atomically. Returns None,
    or one line saying why nothing was written (no cache directory, read-only, an OSError). Never raises."""
    if not records:
        return None
    if not cache.base.is_dir():
        return f"no cache at {cache.root} (the kernels were not loaded from one): tuning not recorded"
    if cache.read_only:
        return f"the cache {cache.root} is read-only: tuning not recorded"
    target = path_of(cache, scope_name)
    try:
        for d in (tuning_dir(cache), cache.locks_dir):
            d.mkdir(parents=True, exist_ok=True)
        with locks.held(cache.locks_dir / "tuning.lock", wait=True, on_error=lambda e, p: e):
            new = {f"{n}x{m}": _value(r) for (n, m), r in records.items()}
            old = {f"{n}x{m}": _value(r) for (n, m), r in load(cache, scope_name).items() if f"{n}x{m}" not in new}
            room = max(0, MAX_SHAPES - len(new))  # past the bound the file keeps these shapes, then the others
            merged = {**dict(list(old.items())[:room]), **dict(list(new.items())[:MAX_SHAPES])}
            atomic_write(target, manifest_bytes({"format": FORMAT, "scope": scope_name, "shapes": merged}))
    except OSError as e:
        return describe(e, target, "cannot record the GEMM tuning in")
    return None


def summary(cache: Cache) -> dict[str, int]:
    """scope -> recorded shapes, for every readable scope file (doctor, stats)."""
    out = {}
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(tuning_dir(cache))):
            if name.endswith(".json") and re.fullmatch(r"[A-Za-z0-9.-]{1,160}\.json", name):
                out[name[:-5]] = len(load(cache, name[:-5]))
    return out


def clear(cache: Cache) -> list[str]:
    """Remove every scope's record and any killed writer's temp file (`clean --all`; a live writer's rename then
    fails and it keeps no record); the scopes removed."""
    gone = []
    with contextlib.suppress(OSError):
        for name in os.listdir(tuning_dir(cache)):
            with contextlib.suppress(OSError):
                os.unlink(tuning_dir(cache) / name)
                if name.endswith(".json") and not name.startswith("."):
                    gone.append(name[:-5])
    return sorted(gone)
