"""`musekern bench` (GPU only): qkv_front in chain / after-norm / isolated modes against copy bandwidth,
cuBLAS and an unfused torch chain; qk_norm bandwidth; host costs. See bench/README.md.

Modules: report (pure row math, targets, JSON, table), timing (graphs, events, copy bandwidth),
pred (the PDL predecessor), unfused (the torch baseline), qkv_front / qk_norm / host (measurements),
plot (PNG), runner (the whole run). Importing this package needs no GPU.
"""
from .report import FRONT_MODES, TARGETS

__all__ = ["FRONT_MODES", "TARGETS"]
