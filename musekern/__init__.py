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
