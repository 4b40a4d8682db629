"""prepare: make every planned variant present in the cache (hit, pull from a remote, or compile).

Each variant goes through `Cache.obtain`, whose per-key lock makes concurrent prepares of one cache
(CI ranks, NFS) compile each variant once. `jobs > 1` compiles in worker processes: the CuTe DSL
compiler is not thread-safe, and processes also use both cores. Every key is computed once, here.

Errors: a variant that cannot be built or stored (disk full, an I/O error) is one FAILED result whose error is
one line naming the path and the fix; only a cache that cannot be used at all raises, as a CacheError (one
line). Afterwards the cache is trimmed to its size policy (store/hygiene.py: MUSEKERN_MAX_SIZE or
`musekern gc --set-max-size`), never removing what this plan needs. Each lookup counts a hit or a miss.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import time
from dataclasses import dataclass, field

from ..store import hygiene, lookup
from ..store.cache import Cache, CacheError
from ..store.keys import KeyParts, dsl_version, key_parts
from ..store.lookup import Policy
from .compile import BuildExtraMissing, build_variant

HIT, PULLED, BUILT, FAILED = "hit", "pulled", "built", "failed"


@dataclass
class PrepareResult:
    target: str
    arch: str
    label: str
    key: str
    status: str
    seconds: float = 0.0
    error: str | None = None
    uploaded: bool = False

    def to_json(self) -> dict:
        return {"target": self.target, "arch": self.arch, "variant": self.label, "key": self.key,
                "status": self.status, "seconds": round(self.seconds, 3), "error": self.error,
                "uploaded": self.uploaded}


@dataclass
class PrepareReport:
    results: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    trimmed: list = field(default_factory=list)  # keys the size policy removed afterwards

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        return self.count(FAILED) == 0

    def to_json(self) -> dict:
        return {"ok": self.ok, "counts": {s: self.count(s) for s in (HIT, PULLED, BUILT, FAILED)},
                "results": [r.to_json() for r in self.results], "warnings": self.warnings, "trimmed": self.trimmed}


def plan_keys(entries, version: str | None = None) -> list[KeyParts]:
    """The key parts of every PlanEntry, in order (the DSL installed here unless `version` is given)."""
    version = dsl_version() if version is None else version
    return [key_parts(e.variant, e.arch, version) for e in entries]


def _prepare_one(cache_root: str, variant, arch: str, parts: KeyParts, sign=None) -> tuple[str, float, str | None]:
    """Worker body (also used in-process): (status, seconds, error)."""
    cache = Cache(cache_root)
    t0 = time.perf_counter()

    def build():
        b = build_variant(variant, arch)
        return b.cubin, b.manifest

    try:
        _, source = cache.obtain(parts, build, sign=sign)
    except CacheError as e:  # the store's errors are one line with their fix already
        return FAILED, time.perf_counter() - t0, str(e)
    except Exception as e:  # reported per variant; prepare goes on with the others
        return FAILED, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return BUILT if source == "built" else HIT, time.perf_counter() - t0, None


def prepare(entries, cache: Cache, jobs: int = 1, remote=None, upload: bool = False, on_done=None,
            plan_name: str | None = None, shard: tuple[int, int] | None = None, sign=None) -> PrepareReport:
    """Make every PlanEntry in `entries` (or its `shard` (K, N), see plan.shard_plan) present in `cache`;
    `on_done(result)` after each one. With `plan_name`, the whole plan's keys are recorded under that name
    (`musekern clean --stale` keeps what some recorded plan needs), also in a shard run. `sign`: the
    store.signing.SecretKey what it builds is signed with (what it uploads: the remote's own `sign_key`).

    A present entry counts only if it verifies (sha256): a corrupt one is rebuilt. Raises
    ReadOnlyCacheError (one line) when something is missing and the cache is read-only, and
    BuildExtraMissing when something must be compiled and the DSL is not installed.
    """
    from ..plan import shard_plan

    report = PrepareReport()
    version = dsl_version()
    all_parts = dict(zip(entries, plan_keys(entries, version or ""), strict=True))
    if plan_name and not cache.read_only:
        try:
            hygiene.record_plan(cache, plan_name, [p.key() for p in all_parts.values()])
        except CacheError as e:  # the record only serves `clean --stale`; the builds say what is wrong
            report.warnings.append(f"plan not recorded: {e}")
    if shard:
        entries = shard_plan(entries, *shard)
    policy = Policy.build(dsl=version)
    missing, used = [], set()  # used: the entries this run serves from, kept by the size policy like the plan's keys

    def finish(res):
        report.results.append(res)
        if on_done:
            on_done(res)

    for e in entries:
        parts = all_parts[e]
        res = PrepareResult(e.target.name, e.arch, e.variant.label, parts.key(), HIT)
        present = lookup.find(cache, parts, policy)
        if present is None:
            missing.append((e, parts, res))
        else:
            used.add(present.key)  # another DSL version's build where no DSL is installed
            if not cache.read_only:
                cache.index(present.parts, present.key)  # entries from before the index get their marker
            finish(res)
    if missing:
        cache.require_writable("prepare")
    todo = []
    for e, parts, res in missing:
        if remote is not None and remote.pull(parts, cache) is not None:
            res.status = PULLED
            finish(res)
        else:
            todo.append((e, parts, res))
    if todo and version is None:
        raise BuildExtraMissing()

    def built(res, out):
        res.status, res.seconds, res.error = out
        finish(res)

    if jobs <= 1 or len(todo) <= 1:
        for e, parts, res in todo:
            built(res, _prepare_one(str(cache.root), e.variant, e.arch, parts, sign))
    else:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold MLIR state
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futs = {pool.submit(_prepare_one, str(cache.root), e.variant, e.arch, parts, sign): res
                    for e, parts, res in todo}
            for f in cf.as_completed(futs):
                try:
                    out = f.result()
                except Exception as e:  # a worker that died (OOM, a signal): its variant failed, not prepare
                    out = (FAILED, 0.0, f"the build worker died ({type(e).__name__}: {e}); run prepare again")
                built(futs[f], out)
    if remote is not None:
        report.warnings.extend(remote.warnings)
        if remote.dead and not report.warnings:
            report.warnings.append(f"remote cache {remote.url} unreachable: compiled locally instead")
        if upload:  # CI warming: the remote ends up with every entry of the plan
            for r in report.results:
                entry = cache.get(r.key) if r.status != FAILED else None
                if entry is not None:
                    r.uploaded = bool(remote.push(entry, cache))
    # counted at the end, once the cache exists (a first prepare creates it): one hit or miss per lookup
    for event, n in (("hit", len(entries) - len(missing)), ("miss", len(missing)), ("built", report.count(BUILT)),
                     ("pulled", report.count(PULLED))):
        hygiene.count(cache, event, n)
    try:  # the lasting size policy, ccache-style: trim after the run, keeping everything this plan needs
        _, trimmed = hygiene.apply_policy(cache, keep={p.key() for p in all_parts.values()} | used,
                                          notes=report.warnings)
        report.trimmed = [e.key for e in trimmed]
    except CacheError as e:
        report.warnings.append(f"size policy not applied: {e}")
    order = {(e.target.name, e.variant.label): i for i, e in enumerate(entries)}
    report.results.sort(key=lambda r: order.get((r.target, r.label), 0))
    return report
