"""GEMM tuning records: what `gemm.tune.tune` measured, kept in the cache so the next process skips the timing.

One file per (GPU, cuBLASLt version) scope, `<cache>/v2/tuning/<scope>.json`: for each (N, M) the candidate kept
("mm" is torch.mm), its algorithm's 64 opaque bytes and workspace, and every candidate's measured us. A GPU model
and a cuBLASLt build give the same speeds wherever they meet; another GPU, SM count or cuBLASLt version is another
scope, so nothing is ever reused across them.

Trust: a record is advice, never authority. The reader (`load`) is bounded (MAX_BYTES, strict field types and
ranges; a bad shape is skipped, a bad file reads as empty, nothing raises), and the product uses a recorded
algorithm only when cuBLASLt offers those exact bytes under that name for the shape now and its result matches
torch.mm's (gemm/tune.py), re-deciding the pick from the recorded times with its own rule. So a corrupt, stale or
crafted file can cost speed (a slower correct algorithm, or torch.mm where an "mm" pick was forged), never a wrong
result, a crash or a hang; `musekern clean --all` removes the records.

Writers (`save`) write only what the reader accepts, merge into the file under the tuning lock and replace it
atomically, within MAX_BYTES (the shapes being written first, then as many others as fit, in key order). The lock is
waited for at most LOCK_WAIT_S: a record is advice, so a writer that cannot take it keeps none rather than stall a
`prepare`. A read-only, missing or full cache keeps no record (one line says why) and the tuning still holds for
the process. A writer killed mid-write leaves only its temp file (the record stays whole), removed by `musekern clean`
once no writer holds the lock. `tuning/` must be a real directory: a symbolic link there is neither read through,
written through nor cleaned through (the store's maintenance treats tuning/ as one of its own folders through
`FOLDER`, store/record_folders.py). Stdlib only.
"""
from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..store import locks, owndirs
from ..store.cache import Cache, CacheError
from ..store.fs import ReadProblem, atomic_write, describe, read_regular
from ..store.manifest import manifest_bytes, parse_json
from ..store.record_folders import RecordFolder

FORMAT = 1
MAX_BYTES = 4 << 20  # the file's bound, read and written: ~800 shapes of 129 candidates, ~4000 of 20
MAX_SHAPES = 8192
MAX_CANDIDATES = 160  # the heuristic's 32 a workspace cap x 4 caps (gemm/cublaslt.py), + torch.mm
ALGO_BYTES = 64  # cublasLtMatmulAlgo_t
MAX_WORKSPACE = 1 << 31
MAX_DIM = 1 << 24
LOCK_WAIT_S = 10.0
_FULL_SAID: set[str] = set()  # scopes whose full file was said in this process
_NAME = re.compile(r"[A-Za-z0-9_.,=\[\]-]{1,100}")
_SCOPE = re.compile(r"[A-Za-z0-9.-]{1,160}")


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
    if not _SCOPE.fullmatch(scope_name):
        raise ValueError(f"not a tuning scope: {scope_name!r}")
    return tuning_dir(cache) / f"{scope_name}.json"


def _real_dir(cache: Cache) -> bool:
    """tuning/ exists as a directory, not a symbolic link (to one) or anything else."""
    try:
        return stat.S_ISDIR(os.lstat(tuning_dir(cache)).st_mode)
    except OSError:
        return False


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


def _value(rec: Record) -> dict:
    v = {"chosen": rec.chosen, "us": {k: round(float(t), 3) for k, t in rec.us.items()}}
    if rec.algo is not None:
        v["algo"], v["workspace"] = rec.algo.hex(), rec.workspace
    return v


def load(cache: Cache, scope_name: str) -> dict[tuple[int, int], Record]:
    """(N, M) -> Record of a scope's file: empty when there is none, it cannot be read, or it is not ours; shapes
    whose record is malformed are left out. Never raises."""
    if not _real_dir(cache):
        return {}
    try:
        d = parse_json(read_regular(path_of(cache, scope_name), MAX_BYTES), "tuning record")
    except (OSError, ValueError, ReadProblem):
        return {}
    if not isinstance(d, dict) or type(d.get("format")) is not int or d["format"] != FORMAT:
        return {}
    shapes = d.get("shapes")
    if d.get("scope") != scope_name or not isinstance(shapes, dict) or len(shapes) > MAX_SHAPES:
        return {}
    out = {}
    for k, v in shapes.items():
        key, rec = _shape(k), _record(v)
        if key is not None and rec is not None:
            out[key] = rec
    return out


def lock_path(cache: Cache) -> Path:
    return cache.locks_dir / "tuning.lock"


def _locked(cache: Cache):
    """The tuning lock (locks/tuning.lock), tried for up to LOCK_WAIT_S: yields whether it is held (also where the
    filesystem has no locks, NFS `nolock`: records are advice). OSError where the lock file cannot be made or
    opened."""
    return locks.held(lock_path(cache), wait=True, on_error=lambda e, p: e, timeout=LOCK_WAIT_S)


def _fit(new: dict, old: dict, scope_name: str) -> tuple[bytes, int]:
    """(the file's bytes, how many shapes they hold): every shape of `new`, then of `old`, as many as MAX_SHAPES and
    MAX_BYTES allow."""
    items = list(new.items()) + [(k, v) for k, v in old.items() if k not in new]
    items = items[:MAX_SHAPES]
    while True:
        raw = manifest_bytes({"format": FORMAT, "scope": scope_name, "shapes": dict(items)})
        if len(raw) <= MAX_BYTES or not items:
            return raw, len(items)
        items = items[:max(0, len(items) - max(1, (len(raw) - MAX_BYTES) * len(items) // len(raw) + 1))]


def save(cache: Cache, scope_name: str, records: dict[tuple[int, int], Record]) -> str | None:
    """Merge `records` into the scope's file (theirs win per shape). Returns None, or one line saying why not all of
    them were written (no cache directory, read-only, the lock busy, a record the reader would refuse, an OSError).
    Never raises."""
    good = {f"{n}x{m}": _value(r) for (n, m), r in records.items()
            if _shape(f"{n}x{m}") is not None and _record(_value(r)) is not None}
    bad = len(records) - len(good)
    why = f"{bad} of {len(records)} tuning record(s) not valid (not written)" if bad else None
    if not good:
        return why
    if not cache.base.is_dir():
        return f"no cache at {cache.root} (the kernels were not loaded from one): tuning not recorded"
    if cache.read_only:
        return f"the cache {cache.root} is read-only: tuning not recorded"
    target, step = path_of(cache, scope_name), tuning_dir(cache)
    try:
        for step in (tuning_dir(cache), cache.locks_dir):
            step.mkdir(exist_ok=True)
        if not _real_dir(cache):
            return f"{tuning_dir(cache)} is not a directory (a symbolic link?): remove it; tuning not recorded"
        step = lock_path(cache)
        with _locked(cache) as held:
            if not held:
                return f"{step} was held for {LOCK_WAIT_S:.0f} s by another process: tuning not recorded"
            step = target
            old = {f"{n}x{m}": _value(r) for (n, m), r in load(cache, scope_name).items()}
            raw, kept = _fit(good, old, scope_name)
            atomic_write(target, raw)
    except OSError as e:
        return describe(e, step, "cannot record the GEMM tuning in")
    except CacheError as e:  # a lock file that is a directory, a link where a directory should be
        return f"GEMM tuning not recorded: {e}"
    dropped = len(good) + sum(k not in good for k in old) - kept
    if dropped and scope_name not in _FULL_SAID:  # said once per process and scope: the next save drops them too
        _FULL_SAID.add(scope_name)
        full = (f"{dropped} of {kept + dropped} GEMM tuning records not kept: {target} holds at most "
                f"{MAX_BYTES >> 20} MiB / {MAX_SHAPES} shapes (the shapes just measured first); those shapes are "
                "timed again in each new process (`musekern clean --all` clears the file)")
        return f"{why}; {full}" if why else full
    return why


def scope_files(cache: Cache) -> list[str]:
    """The scopes that have a record file (readable or not), for `clean --all` and its dry run."""
    if not _real_dir(cache):
        return []
    try:
        names = os.listdir(tuning_dir(cache))
    except OSError:
        return []
    return sorted(n[:-5] for n in names if n.endswith(".json") and _SCOPE.fullmatch(n[:-5]) and n[0] != ".")


def summary(cache: Cache) -> dict[str, int]:
    """scope -> recorded shapes, for every scope file (`stats`)."""
    return {s: len(load(cache, s)) for s in scope_files(cache)}


def _debris(cache: Cache) -> list[str]:
    try:
        return [n for n in os.listdir(tuning_dir(cache)) if n.startswith(".") and n.endswith(".tmp")]
    except OSError:
        return []


def _remove(cache: Cache, names) -> list[str]:
    """Unlink `names()` from tuning/ while holding the tuning lock (nothing if a writer holds it past LOCK_WAIT_S, or
    tuning/ is no real directory); the names removed."""
    gone = []
    if _real_dir(cache):
        with contextlib.suppress(OSError), owndirs.opened(cache.root, tuning_dir(cache)) as fd:
            owndirs.make(cache.root, cache.locks_dir)  # a missing locks/ would keep every record, silently
            with _locked(cache) as held:
                for name in names() if held and fd is not None else ():
                    if owndirs.remove(fd, name):  # through tuning/'s fd: no link followed
                        gone.append(name)
    return gone


def clean_debris(cache: Cache, dry_run: bool = False) -> int:
    """Remove killed writers' temp files (`musekern clean`), only while no writer holds the lock. How many were (dry
    run: would be) removed."""
    if dry_run:
        return len(_debris(cache)) if _real_dir(cache) else 0
    return len(_remove(cache, lambda: _debris(cache)))


def clear(cache: Cache) -> list[str]:
    """Remove every scope's record and killed writers' temp files (`clean --all`), under the tuning lock (none
    removed if a writer holds it past LOCK_WAIT_S); the scopes removed."""
    gone = _remove(cache, lambda: [f"{s}.json" for s in scope_files(cache)] + _debris(cache))
    return sorted(n[:-5] for n in gone if not n.startswith("."))


# what the store's maintenance (clean, clean --all, stats) sees of these records: `import musekern` registers it
FOLDER = RecordFolder(name="gemm_tuning", what="GEMM tuning record", path=tuning_dir, lock=lock_path,
                      files=scope_files, summary=summary, clean_debris=clean_debris, clear=clear)
