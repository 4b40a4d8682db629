"""What every kernel variant offers the cache and the CLI (pure Python, no cutlass)."""
from __future__ import annotations

import dataclasses
import json


class VariantMixin:
    """Mixed into each kernel's frozen variant dataclass.

    `params()` is the variant's named parts, the unit of the cache key (never positional).
    """

    kernel: str = ""  # overridden per kernel as a ClassVar

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def label(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params().items()))
        return f"{self.kernel}[{inner}]"

    def to_json(self) -> str:
        return json.dumps({"kernel": self.kernel, **self.params()}, sort_keys=True)
