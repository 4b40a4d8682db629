"""The research benchmark harness (GPU only; outside the wheel): qkv_front in chain / after-norm / isolated modes
against copy bandwidth, cuBLAS and an unfused torch chain; qk_norm bandwidth; host costs; the all-M table. Run it as
`python3 -m bench.harness` with the repository root on PYTHONPATH (bench/device_env.sh); see bench/README.md.

Modules: report (pure row math, targets, JSON, table), timing (graphs, events, copy bandwidth), pred (the PDL
predecessor), unfused (the torch baseline), qkv_front / qk_norm / host / all_m (measurements), plot (PNG), runner
(the whole run), __main__ (the command). Importing this package needs no GPU.
"""
from .report import FRONT_MODES, TARGETS

__all__ = ["FRONT_MODES", "TARGETS"]
