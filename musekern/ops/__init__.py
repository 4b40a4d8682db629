"""torch-facing ops: checks, then a launch of the cached kernel (no compiler at run time).

`musekern.ops.qk_norm` and `musekern.ops.qkv_front` are the modules (nothing is re-exported here,
so a function never shadows its module); `musekern.qk_norm(...)`, `musekern.qkv_front(...)` and
`musekern.qkv_front_auto(...)` are the functions.
"""
