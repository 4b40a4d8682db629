"""The artifact contract build and runtime both stand on (stdlib only: no cutlass, torch or CUDA here).

    keys.py      the key: its named parts, how it is made, the one label spelling, the DSL version
    abi.py       the launch-ABI record a manifest carries, and its PTX `.entry` / ELF checks
    manifest.py  manifest.json: bounded JSON, canonical bytes, the digest, every check a reader applies
    elf.py       what a cubin records about its kernels (symbol, parameter sizes, block) to check the ABI against
    cache.py     the on-disk cache: entries, atomic commit, per-key locks, read + verify (why it is safe: there)
    lookup.py    the one "is this variant present?" with an explicit policy
    hygiene.py   recorded plans, stats and counters, gc, the size policy, staging debris, clear, repair
    remote.py    a Bazel-protocol HTTP cache; bundle.py: reproducible, verified tar bundles (tarread.py: bounded)
    signing.py   ed25519 signatures on manifests, the keys a consumer trusts (cryptography, imported lazily)
    variant_abi.py  the hook that checks a manifest's ABI against what its variant declares (filled by the package)
    access.py    can the cache dir be read / written, and the one-line error when not; errors.py: the errors
    locks.py     per-key flock; fs.py: bounded reads, durable and atomic writes, OSErrors in one line
"""
