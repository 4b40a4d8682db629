"""What every kernel variant offers the cache and the CLI (pure Python, no cutlass)."""
from __future__ import annotations

import dataclasses
import json

from ..store.keys import variant_label


class VariantMixin:
    """Mixed into each kernel's frozen variant dataclass.

    `params()` is the variant's named parts, the unit of the cache key (never positional). A field at its
    default is left out of params, labels and keys: adding a lever (with the old behaviour as its default)
    leaves every existing key as it was, and dropping an unused one does too.
    """

    kernel: str = ""  # overridden per kernel as a ClassVar

    def params(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                out[f.name] = value
        return out

    @property
    def label(self) -> str:
        return variant_label(self.kernel, self.params())

    def to_json(self) -> str:
        return json.dumps({"kernel": self.kernel, **self.params()}, sort_keys=True)
