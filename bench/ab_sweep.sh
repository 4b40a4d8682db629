#!/usr/bin/env bash
# A/B of two builds of the same labels on the GPU machine, in one call: the current tree with its cache
# (.musekern-cache) against another tree's musekern + bench (OLD_TREE, e.g. a copy of a worktree at an older
# commit) with the cache built from it (OLD_CACHE). The cache keys hash the kernel source, so each side runs
# its own code. Rounds alternate (old, new, old, new, ...) so drift hits both; sweep_variants.py JSON per round.
# Usage: bash bench/ab_sweep.sh OLD_TREE OLD_CACHE ROUNDS LABELS_FILE [--m 1,16]
#   carry [".musekern-cache", ".whl", OLD_TREE, OLD_CACHE] (LABELS_FILE committed or carried too)
set -uo pipefail
OLD_TREE=$1 OLD_CACHE=$2 ROUNDS=$3 LABELS=$4
shift 4
source "$(dirname "$0")/device_env.sh"
mapfile -t labels < "$LABELS"
for r in $(seq 1 "$ROUNDS"); do
  ( export PYTHONPATH="$PWD/$OLD_TREE:/tmp/site" MUSEKERN_CACHE_DIR="$PWD/$OLD_CACHE"
    python3 "$OLD_TREE/bench/sweep_variants.py" "$DEST/ab-old-r$r.json" "${labels[@]}" "$@" 2>/dev/null | tail -n +2 | sed 's/^/old /' )
  python3 bench/sweep_variants.py "$DEST/ab-new-r$r.json" "${labels[@]}" "$@" 2>/dev/null | tail -n +2 | sed 's/^/new /'
done
