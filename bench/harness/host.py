"""Host-side costs: per eager call of `launch` (no checks) and `qkv_front` (with checks), and the first
call in a fresh process with a warm cache (cubin load + launch, no compile), apart from torch/CUDA init.

FIRST_CALL_SRC (run with `python -c SRC N NUM_KV_HEADS M`) is the fresh process; it prints one JSON line.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: bench/harness/..


def per_call_us(fn, batches: int = 7, calls: int = 200) -> float:
    """Median host time of one call: batches of `calls`, synchronised between batches so the launch queue
    never fills (a full queue would make the host wait for the GPU and time the kernel instead)."""
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        ts.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


def _inputs(n: int, nkv: int, m: int, eps: float = 1e-6, theta: float = 10000.0):
    import torch

    from musekern.reference import rope_cos_sin_table

    from .qkv_front import BLOCK_SIZE, MAX_POS, NUM_BLOCKS

    g = torch.Generator(device="cuda").manual_seed(5)
    bf = torch.bfloat16
    kv = torch.randn((2, NUM_BLOCKS, BLOCK_SIZE, nkv, 64), device="cuda", generator=g).to(bf)
    return dict(x=torch.randn(m, 8192, device="cuda", generator=g).to(bf),
                weight=(torch.randn(n, 8192, device="cuda", generator=g) * 0.02).to(bf),
                positions=torch.randint(0, MAX_POS, (m,), device="cuda", generator=g),
                cos_sin_cache=rope_cos_sin_table(MAX_POS, theta, "cuda"),
                slot_mapping=torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda", generator=g)[:m],
                key_cache=kv[0], value_cache=kv[1], num_kv_heads=nkv, eps=eps,
                out=torch.empty(m, n, dtype=bf, device="cuda"), k_scale=None, v_scale=None, weight_scale=None)


def measure_eager(n: int, nkv: int, m: int) -> dict:
    """us per eager call of ops.launch and ops.qkv_front (same inputs, `out` given: no allocation)."""
    from musekern.ops import qkv_front as ops

    a = tuple(_inputs(n, nkv, m).values())  # positional, in the ops' parameter order (no dict unpack timed)
    return {"shape": {"N": n, "num_kv_heads": nkv, "M": m},
            "launch_us": per_call_us(lambda: ops.launch(*a)),
            "qkv_front_us": per_call_us(lambda: ops.qkv_front(*a))}


def first_call_subprocess(n: int, nkv: int, m: int, timeout: float = 180.0) -> dict:
    """Run the fresh-process measurement (same env: PYTHONPATH with the repository root first, for bench.harness;
    MUSEKERN_CACHE_DIR) and parse its JSON."""
    cmd = [sys.executable, "-c", FIRST_CALL_SRC, str(n), str(nkv), str(m)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": f"rc={r.returncode}: {(r.stderr or r.stdout)[-500:]}"}
    return json.loads(lines[-1])


# Run with `python -c` so that nothing of musekern is imported before the clock starts.
FIRST_CALL_SRC = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
from musekern.ops import qkv_front as ops
from bench.harness.host import _inputs
t3 = time.perf_counter()
n, nkv, m = map(int, sys.argv[1:4])
a = tuple(_inputs(n, nkv, m).values())
torch.cuda.synchronize()
t4 = time.perf_counter()
ops.qkv_front(*a)  # cache lookup + sha256 + cubin load + tensor-map encode + launch: no compile
torch.cuda.synchronize()
t5 = time.perf_counter()
ops.qkv_front(*a)
torch.cuda.synchronize()
t6 = time.perf_counter()
print(json.dumps({"import_torch_ms": (t1 - t0) * 1e3, "cuda_init_ms": (t2 - t1) * 1e3, "import_ms": (t3 - t2) * 1e3,
                  "first_call_ms": (t5 - t4) * 1e3, "second_call_ms": (t6 - t5) * 1e3,
                  "cutlass_imported": "cutlass" in sys.modules, "shape": {"N": n, "num_kv_heads": nkv, "M": m}}))
"""
