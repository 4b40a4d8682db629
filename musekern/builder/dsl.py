"""The CuTe DSL compile step of the builder (imports cutlass: only musekern.builder.compile imports it)."""
from __future__ import annotations

import os
import tempfile

# The DSL's own file cache (/tmp/cute_dsl_python_cache_*) would be a second, unkeyed cache under ours: every compile
# that prepare asks for must really compile (reproducibility is tested that way). Set before cutlass is imported
# (it reads its environment once); the builder imports this module before any kernel module.
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

import cutlass.cute as cute  # noqa: E402

from ..store.abi import ptx_entry_names


def compile_to_cubin(jit_fn, *args, arch: str) -> tuple[bytes, str, str]:
    """`cute.compile` `jit_fn(*args)` for `arch` on any machine (no GPU needed).

    Returns (cubin bytes, PTX text, entry symbol). Exactly one kernel entry is expected.
    """
    # --keep-cubin/--keep-ptx also dump files; give them a private folder (NOTES.md pitfall 12).
    # CuTe DSL reads CUTE_DSL_DUMP_DIR once per process, so --dump-dir is what moves them per compile.
    with tempfile.TemporaryDirectory(prefix="musekern-dsl-") as dump:
        old = os.environ.get("CUTE_DSL_DUMP_DIR")
        os.environ["CUTE_DSL_DUMP_DIR"] = dump
        try:
            c = cute.compile(jit_fn, *args, options=f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir={dump}")
        finally:
            if old is None:
                os.environ.pop("CUTE_DSL_DUMP_DIR", None)
            else:
                os.environ["CUTE_DSL_DUMP_DIR"] = old
        cubin, ptx = c.artifacts.CUBIN, c.artifacts.PTX
        if isinstance(cubin, str) and os.path.exists(cubin):
            cubin = open(cubin, "rb").read()
        if isinstance(ptx, str) and os.path.exists(ptx):
            ptx = open(ptx).read()
    if not isinstance(cubin, bytes) or cubin[:4] != b"\x7fELF":
        raise RuntimeError(f"cute.compile produced no cubin for {arch} (got {type(cubin).__name__})")
    names = list(c.kernel_info)
    if len(names) != 1:
        raise RuntimeError(f"expected one kernel entry, got {names}")
    symbol = names[0]
    if symbol not in ptx_entry_names(ptx):
        raise RuntimeError(f"kernel {symbol} is not an .entry of the PTX")
    return cubin, ptx, symbol
