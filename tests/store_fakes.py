"""Fake entries for the store tests: no GPU and no compiler, so these tests run in seconds on 2 cores.

A fake build writes a deterministic fake cubin per key (compiles are deterministic too) and a manifest
shaped like the builder's (a real launch-ABI record, so every check the loader relies on applies).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from musekern.store.abi import KernelAbi, LaunchSpec, pointer, scalar
from musekern.store.cache import Cache
from musekern.store.keys import KeyParts, variant_tag

SRC = "ab" * 32


def fake_parts(i: int = 0, kernel: str = "qk_norm", arch: str = "sm_90a", dsl: str = "4.8.1",
               src: str = SRC, abi: int = 1) -> KeyParts:
    return KeyParts.make(kernel, {"dtype": "bfloat16", "head_dim": 64, "has_scale": bool(i % 2), "i": i},
                         arch, src, dsl, abi)


def fake_cubin(parts: KeyParts) -> bytes:
    """Deterministic bytes per key (compiles are deterministic: same inputs, same cubin)."""
    return b"\x7fELF" + hashlib.sha256(parts.key().encode()).digest() * 8


FAKE_ABI = KernelAbi((pointer("x"), pointer("out"), scalar("m", "i32")), LaunchSpec((256, 1, 1)))


def abi_json(kernel: str, params: dict) -> dict:
    """The ABI a fake entry records: what a real variant declares (the store refuses any other under its key: the
    provider `import musekern` registers), FAKE_ABI for the fakes' own variants (an `i` param: nothing declared)."""
    from musekern.store import variant_abi

    declared = variant_abi.get_provider()(kernel, params)
    return (declared or FAKE_ABI).to_json()


def fake_symbol(kernel: str, params: dict, stem: str = "kernel") -> str:
    """An entry symbol as the kernels compile it: with the variant's tag (store/variant_abi.py asks for it)."""
    return f"{stem}_{kernel}_{variant_tag(kernel, params)}"


def fake_manifest(parts: KeyParts) -> dict:
    """What the builder hands to Cache.put (builder/compile.py: label, variant, symbol, arch, ABI, built_with)."""
    return {"kernel": parts.kernel, "label": parts.label, "variant": parts.variant_params,
            "symbol": fake_symbol(parts.kernel, parts.variant_params), "arch": parts.arch,
            "abi": abi_json(parts.kernel, parts.variant_params),
            "built_with": {"nvidia-cutlass-dsl": parts.dsl_version}}


def fake_build(parts: KeyParts, counter: Path | None = None):
    def build():
        if counter is not None:
            with open(counter, "a") as f:  # O_APPEND: one line per build, from any process
                f.write(parts.key() + "\n")
        return fake_cubin(parts), fake_manifest(parts)
    return build


def put(cache: Cache, parts: KeyParts):
    return cache.put(parts, fake_cubin(parts), fake_manifest(parts))


def filled(path: Path, idx, order=None) -> Cache:
    c = Cache(path)
    for i in (order or idx):
        put(c, fake_parts(i))
    return c


def tree(root: Path) -> dict:
    """Snapshot of every path under root with its mtime and size (to prove nothing was written)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath, n)
            st = p.lstat()
            out[str(p)] = (st.st_mtime_ns, st.st_size)
    return out


def chmod_w(path: Path) -> None:
    """Entry files are 0444: make one writable so a test can damage it (also as non-root)."""
    os.chmod(path, 0o644)


def as_other_user() -> list[str]:
    """The command prefix that makes a child unable to read a file chmod 000: `setpriv` to nobody as root."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@functools.lru_cache(maxsize=None)
def real_builds() -> tuple:
    """Two real compiled entries, (parts, cubin, builder manifest) each, compiled once per test process (CuTe DSL
    on the CPU, ~3 s each): qk_norm variants that differ in dtype, head_dim and scale, so their cubins have
    different symbols and parameter lists. Skips where the build extra is not installed."""
    import importlib.util

    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs the build extra (nvidia-cutlass-dsl) to compile a real cubin")
    from musekern.builder.compile import build_variant
    from musekern.kernels.qk_norm.variant import QkNormVariant
    from musekern.store.keys import dsl_version, key_parts

    out = []
    for v in (QkNormVariant("bfloat16", 64, False), QkNormVariant("float16", 128, True)):
        b = build_variant(v, "sm_90a")
        out.append((key_parts(v, "sm_90a", dsl_version()), b.cubin, b.manifest))
    return tuple(out)


def fail_writes_under(monkeypatch, root: Path, after_bytes: int = 0) -> None:
    """Every os.write into a file under `root` fails with ENOSPC once `after_bytes` were written there: a disk
    that fills up, wherever the store writes (undone with monkeypatch.undo())."""
    import errno

    real = os.write
    budget = [after_bytes]

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(str(root)):
            if budget[0] < len(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            budget[0] -= len(data)
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


@contextlib.contextmanager
def lock_held_elsewhere(cache: Cache, key: str):
    """`key`'s lock held by another thread (flock excludes it there as it would another process: a writer at
    work) for the duration of the block."""
    import threading

    holding, release = threading.Event(), threading.Event()

    def writer():
        with cache.lock(key):
            holding.set()
            release.wait(30)

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert holding.wait(30)
        yield
    finally:
        release.set()
        t.join()


# ---------------------------------------------------------------- planted links (issue 28, finding 2)
# every directory the store makes below the cache directory; FAMILY stands for the one index/<family>/ there
OWN_DIRS = ("v2", "v2/entries", "v2/tmp", "v2/locks", "v2/used", "v2/plans", "v2/index", "v2/index/FAMILY",
            "v2/stats", "v2/tuning")


def lived_in(root: Path, n: int = 4) -> tuple[Cache, list[str]]:
    """A cache with something in each of its own directories: entries (so index/ and locks/), a recorded plan
    (one entry of it: the others are stale), last-used stamps, counters, a dead writer's staging dir, a GEMM
    tuning record and a killed tuning writer's temp file."""
    from musekern.store import hygiene

    c = Cache(root)
    ps = [fake_parts(i) for i in range(n)]
    for p in ps:
        put(c, p)
        c.touch(p.key())
    hygiene.record_plan(c, "cfg|h200", [ps[0].key()])
    hygiene.count(c, "hit", 3)
    (c.tmp_dir / f"{fake_parts(99).key()}.1.dead").mkdir()
    (c.tmp_dir / "stray").write_text("debris")
    tuning = c.base / "tuning"
    tuning.mkdir()
    (tuning / "gpu.sm90.132sms.cublaslt1.json").write_text("{}")
    (tuning / ".gpu.sm90.132sms.cublaslt1.json.1.dead.tmp").write_text("{")
    return c, [p.key() for p in ps]


def plant_outside(cache: Cache, rel: str, outside: Path, keys) -> Path:
    """Replace the cache's own directory `rel` (from OWN_DIRS) with a symbolic link to `outside`, a directory of
    sentinel files named as that directory's own items would be (keys, key.lock, counters, plans, staging names,
    tuning records and temp files, key-named directories), plus, for v2, a copy of the whole of v2. Returns the
    planted path."""
    outside.mkdir(parents=True)
    names = ["a.txt", "p.json", "hit", "miss", "built", "pulled", "tuning.lock", "stray",
             "gpu.sm90.132sms.cublaslt1.json", ".gpu.sm90.132sms.cublaslt1.json.1.dead.tmp"]
    names += [*keys, *(f"{k}.lock" for k in keys), *(f"{k}.1.dead" for k in keys)]
    for name in names:
        (outside / name).write_text("sentinel")
    for k in keys[:2]:
        (outside / f"trash.{k}.1.x").mkdir()
        (outside / f"trash.{k}.1.x" / "kernel.cubin").write_text("sentinel")
    if rel == "v2/index/FAMILY":
        rel = f"v2/index/{sorted(os.listdir(cache.index_dir))[0]}"
    planted = cache.root / rel
    if rel == "v2":
        shutil.copytree(planted, outside, symlinks=True, dirs_exist_ok=True)
    shutil.rmtree(planted)
    planted.symlink_to(outside, target_is_directory=True)
    return planted


def fake_builds(monkeypatch):
    """prepare() without the compiler: each variant 'compiles' to a fake cubin with a real-shaped manifest."""
    from musekern.builder import prepare as prepare_mod
    from musekern.builder.compile import Built

    def build_variant(variant, arch):
        cubin = b"\x7fELF" + hashlib.sha256(f"{variant.label}{arch}".encode()).digest() * 64
        return Built(cubin, {"kernel": variant.kernel, "label": variant.label, "variant": variant.params(),
                             "symbol": fake_symbol(variant.kernel, variant.params()), "arch": arch,
                             "abi": abi_json(variant.kernel, variant.params()),
                             "built_with": {}})

    monkeypatch.setattr(prepare_mod, "build_variant", build_variant)
    return prepare_mod
