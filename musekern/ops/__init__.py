"""torch-facing ops: checks, then a launch of the cached kernel (no compiler at run time)."""
from .qk_norm import qk_norm, qk_norm_unsupported

__all__ = ["qk_norm", "qk_norm_unsupported"]
