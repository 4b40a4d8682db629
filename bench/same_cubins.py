#!/usr/bin/env python3
"""Are the cubins this tree compiles the ones a cache holds? (CPU only; needs the build extra.)

A change to a kernel's source file changes every key of that kernel (store/keys.py hashes the sources), also when
it only edits comments; GPU results measured on the earlier cubins still hold if the bytes did not change. This
compiles every planned h200 build (the bundled model's plan, with an FP8 KV cache, and with each e4m3 weight format
gpu_cache.sh prepares: `PLANS`) and every build the GPU tests launch (tests/qkv_front_builds.py) and compares
each cubin's sha256 and kernel symbol with the manifest of the entry of the same label in CACHE (keys differ; labels
do not, once spelled with today's parameter names: RENAMED).

  python3 bench/same_cubins.py CACHE        exit 0 when every build is in CACHE with the same bytes and symbol
  python3 bench/same_cubins.py --plans      the plans, one "KV_CACHE_DTYPE WEIGHT_FORMAT" a line (gpu_cache.sh)
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


# the plans gpu_cache.sh prepares: (kv_cache_dtype, weight_format) overrides of the bundled model
PLANS = (("auto", "auto"), ("fp8", "auto"), ("auto", "fp8-channel"), ("auto", "fp8-block"), ("fp8", "fp8-block"))

# parameters renamed since a cache was built (issue 27: one name per idea): old name -> today's
RENAMED = {"splits": "k_split", "fixed_m": "fixed_rows"}


def cached_digests(cache: str) -> dict:
    """label -> (cubin sha256, kernel symbol) of every entry in a cache (from its manifest); labels spelled with
    today's parameter names, so a cache built before a rename still compares."""
    from musekern.store.keys import variant_label

    out = {}
    for path in glob.glob(os.path.join(cache, "v*", "entries", "*", "manifest.json")):
        with open(path) as f:
            doc = json.load(f)
        params = {RENAMED.get(k, k): v for k, v in doc["variant"].items()}
        out[variant_label(doc["kernel"], params)] = (doc["cubin_sha256"], doc["symbol"])
    return out


def compare(cache: str, builds) -> list[str]:
    """One line per build whose sm_90a cubin compiled here is not the one CACHE holds under its label."""
    from musekern.builder.compile import compile_variant

    old = cached_digests(cache)
    bad = []
    for v in builds:
        ck = compile_variant(v, "sm_90a")
        if old.get(v.label) != (hashlib.sha256(ck.cubin).hexdigest(), ck.symbol):
            bad.append(f"{'missing' if v.label not in old else 'differs'}: {v.label}")
    return bad


def main(argv) -> int:
    from qkv_front_builds import gpu_test_builds

    from musekern.config import load_config, with_kv_cache_dtype, with_weight_format
    from musekern.plan import plan_model
    from musekern.targets import get_target

    if argv == ["--plans"]:
        print("\n".join(f"{kv} {wf}" for kv, wf in PLANS))
        return 0
    if len(argv) != 1:
        print("\n".join(ln.strip() for ln in __doc__.splitlines() if "same_cubins.py" in ln), file=sys.stderr)
        return 2
    model = load_config()
    planned = [e.variant for e in plan_model(model, [get_target("h200")])]
    builds = planned + gpu_test_builds([v for v in planned if v.kernel == "qkv_front"])
    for kv, wf in PLANS[1:]:
        builds += [e.variant for e in plan_model(with_weight_format(with_kv_cache_dtype(model, kv), wf),
                                                 [get_target("h200")])]
    builds = list(dict.fromkeys(builds))
    bad = compare(argv[0], builds)
    for line in bad:
        print(line)
    print(f"{len(builds) - len(bad)} of {len(builds)} builds: the same cubin as in {argv[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
