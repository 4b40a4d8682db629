# Sourced by the GPU-machine scripts (gpu_round.sh, gpu_bench.sh): the repo on PYTHONPATH (no install
# there), the carried cache, the carried wheels (platformdirs), and DEST for results (the device's $OUT).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 MUSEKERN_CACHE_DIR="$PWD/.musekern-cache"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The carried tree has no bytecode (git ignores __pycache__); a pip install compiles it. Do the same once,
# so a fresh process (the bench's first-call measurement) reads .pyc files as an installed musekern would.
python3 -m compileall -q musekern >/dev/null 2>&1 || true
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
nvidia-smi -L >&2 || true
