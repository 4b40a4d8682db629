"""torch-facing ops: checks, then a launch of the cached kernel (no compiler at run time).

`musekern.ops.qk_norm` and `musekern.ops.qkv_front` are the modules (nothing is re-exported here,
so a function never shadows its module); `musekern.qk_norm(...)`, `musekern.qkv_front(...)` and
`musekern.qkv_front_auto(...)` are the functions.
"""

try:  # torch is the engine's (or `musekern[torch]`): musekern's install does not pull it, so say what to do
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError("musekern's ops (musekern.qk_norm, musekern.qkv_front) need torch: use your engine's "
                              "torch, or pip install 'musekern[torch]'", name="torch") from None
