"""musekern: ahead-of-time CuTe DSL kernels for the Muse Spark decode attention front.

`import musekern` is cheap (no torch, no CUDA, no cutlass); the ops load on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "qk_norm": ("musekern.ops.qk_norm", "qk_norm"),
    "qkv_front": ("musekern.ops.qkv_front", "qkv_front"),
    "qkv_front_auto": ("musekern.ops.qkv_front", "qkv_front_auto"),
    # torch.ops.musekern.{qkv_front, qk_norm}: registered when musekern.ops.library is imported (either name does)
    "register_ops": ("musekern.ops.library", "register_ops"),
    "prepare_ops": ("musekern.ops.library", "prepare"),
    "get_kernel": ("musekern.runtime", "get_kernel"),
    "load_config": ("musekern.config", "load_config"),
    "get_target": ("musekern.targets", "get_target"),
    "plan_model": ("musekern.plan", "plan_model"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'musekern' has no attribute {name!r}")


def _declared_abi(kernel: str, params: dict):
    """What a variant's kernel declares about its launch (kernels.declared_abi: each kernel's cutlass-free ABI record),
    for the store's variant-vs-ABI check; imported on the first check, so `import musekern` stays cheap."""
    from .kernels import declared_abi

    try:
        return declared_abi(kernel, params)
    except ValueError:  # a kernel or variant this musekern does not know: it never loads it, nothing to compare
        return None


def _gemm_records():
    """The GEMM tuning records' folder (gemm/records.py), for the store's maintenance (clean, stats); imported on first
    use, so `import musekern` stays cheap."""
    from .gemm.records import FOLDER

    return FOLDER


def _register_store_hooks() -> None:
    from .store import record_folders, variant_abi  # stdlib only: keeps `import musekern` cheap

    if variant_abi.get_provider() is None:
        variant_abi.set_provider(_declared_abi)
    record_folders.register(_gemm_records)


_register_store_hooks()
