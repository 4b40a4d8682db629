"""The artifact contract build and runtime both stand on (stdlib only: no cutlass, torch or CUDA here).

    keys.py     the key: its named parts, how it is made, the one label spelling, the DSL version
    abi.py      the launch-ABI record a manifest carries, and its PTX `.entry` / ELF checks
    cache.py    the on-disk cache: entries, atomic commit, per-key locks, read + verify
    lookup.py   the one "is this variant present?" with an explicit policy
    hygiene.py  recorded plans, stats, gc, staging debris, clear
    remote.py   a Bazel-protocol HTTP cache; bundle.py: reproducible, verified tar bundles
    fs.py       durable and atomic file writes
"""
