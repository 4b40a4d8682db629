"""The KV cache dtypes musekern writes, in vLLM's `kv_cache_dtype` vocabulary (pure: no torch, no cutlass).

A build of qkv_front or qkv_epilogue writes one cache dtype (its variant's `kv_cache_dtype`, "bf16" by default and
then left out of its label and key): "bf16", or "fp8_e4m3" = vLLM's `--kv-cache-dtype fp8` / `fp8_e4m3`: byte =
e4m3 round-to-nearest-even, saturated to +-448, of float(k_bf16) / k_scale (a true fp32 division), as vLLM's
`reshape_and_cache_flash` stores it (musekern.reference.e4m3_rows). The config's `musekern.kv_cache_dtype` and the
planning commands' `--kv-cache-dtype` take CHOICES; `resolve` maps them to a build's dtype.
"""
from __future__ import annotations

BF16 = "bf16"
FP8_E4M3 = "fp8_e4m3"
KV_CACHE_DTYPES = (BF16, FP8_E4M3)  # what a build writes
CHOICES = ("auto", "bf16", "fp8", "fp8_e4m3")  # what --kv-cache-dtype and musekern.kv_cache_dtype take
_ALIASES = {"auto": BF16, "bf16": BF16, "bfloat16": BF16, "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3}
E4M3_MAX = 448.0  # the largest finite e4m3 (fn) value: SATFINITE clamps to it
E5M2_REASON = ("fp8_e5m2 KV caches are not served: musekern writes e4m3 (--kv-cache-dtype fp8 / fp8_e4m3, the FP8 "
               "cache vLLM's FlashAttention backends read)")


# The four launch parameters an FP8 build of qkv_front or qkv_epilogue takes after its bf16 ones, as (name, "ptr" or
# a scalar type, doc): a scale tensor's address (0 for a float or none: the kernel then takes the value), and the
# value. Their abi.py declare them (`scale_param`), ops/checks.py SCALE_VALUES computes them from a call.
SCALE_PARAMS = (("k_scale_ptr", "ptr", "float32 k_scale on the device, read at launch; 0: take k_scale"),
                ("k_scale", "f32", "the key cache's scale where k_scale_ptr is 0 (stored = e4m3(k / k_scale))"),
                ("v_scale_ptr", "ptr", "float32 v_scale on the device, read at launch; 0: take v_scale"),
                ("v_scale", "f32", "the value cache's scale where v_scale_ptr is 0"))


def resolve(value) -> str:
    """The build dtype ("bf16" or "fp8_e4m3") of a `kv_cache_dtype` value; ValueError with a one-line reason."""
    if isinstance(value, str) and value.strip().lower() in _ALIASES:
        return _ALIASES[value.strip().lower()]
    if isinstance(value, str) and value.strip().lower() == "fp8_e5m2":
        raise ValueError(E5M2_REASON)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise ValueError(f"unknown KV cache dtype {shown}; choose one of {', '.join(CHOICES)}")
