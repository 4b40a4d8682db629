#!/usr/bin/env bash
# One device call for issue 14 (the ops in an engine), on the GPU machine: the GPU tests of tests/test_gpu_engine.py
# (opcheck, inductor, CUDA graphs, the decoder attention block's multi-request run) and bench/engine_host.py (host
# cost per eager call), results to $OUT: engine.junit.xml, engine-tests.json, engine-host.json and the merged
# h200-engine.json; the host table last.
# Device call:  cd .xfer/engine && source bench/device_env.sh && bash bench/gpu_engine.sh
#   (carry the worktree's files, .musekern-cache built with `musekern prepare --target h200` + BUILD_INFO.json,
#    and .whl with the platformdirs wheel)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -m gpu -q -o junit_family=xunit1 -p no:cacheprovider \
  --timeout=120 --timeout-method=thread -rA --junitxml "$DEST/engine.junit.xml" tests/test_gpu_engine.py 2>&1 \
  | tee "$DEST/engine-pytest.txt" | grep -E "^(PASSED|FAILED|XFAIL|ERROR|SKIPPED)|passed|failed" | cut -c1-220
rc=${PIPESTATUS[0]}
python3 bench/gpu_results.py "$DEST/engine.junit.xml" "$DEST/engine-tests.json" | tail -n 4
timeout "${HOST_TIMEOUT:-100}" python3 bench/engine_host.py --out "$DEST/engine-host.json" > "$DEST/engine-host.txt" 2>&1
echo "engine_host rc=$?"
python3 - "$DEST" <<'PY'
import json, os, sys
d = sys.argv[1]
load = lambda n: json.load(open(os.path.join(d, n))) if os.path.exists(os.path.join(d, n)) else None
tests, host = load("engine-tests.json"), load("engine-host.json")
doc = {"command": "cd .xfer/engine && source bench/device_env.sh && bash bench/gpu_engine.sh",
       "commit": (tests or host or {}).get("commit"), "tests": tests, "host": host}
json.dump(doc, open(os.path.join(d, "h200-engine.json"), "w"), indent=1)
for t in (tests or {}).get("tests", []):
    p = t["properties"]
    if "max_err" in p:
        print(f"{t['test'].split('::')[-1]}: {t['outcome']}, max err {float(p['max_err']):.4g}, "
              f"max err/bound {float(p['max_err_over_bound']):.3f}, M > 16 path: {p.get('m_above_16_path')}")
PY
cat "$DEST/engine-host.txt" | tail -n 30
exit $rc
