#!/usr/bin/env python3
"""Host cost of the checked qkv_front per eager call, on a machine without a GPU: the pure-Python work (checks,
binding, the loader's launch path) with only the CUDA driver stubbed, before and after a change, on one CPU.

What is real: musekern's code path from `musekern.qkv_front` / `torch.ops` down to the driver call (the planner's
variant for N=2176 on an H200, the kernel's real launch ABI and parameter block, torch tensors' attribute reads);
what is stubbed: the tensors' device (CPU tensors that say they are on CUDA device 0, as tests/test_ops_qkv_front.py's
`as_if_cuda` does), the driver (module load, tensor-map encode, cuLaunchKernelEx: a Python no-op) and torch's raw
current stream (`abs`, a C builtin, for `torch._C._cuda_getCurrentRawStream`). The GPU machine's numbers, with the
driver, are bench/engine_host.py's; this script tells which Python work a change removed, on a quiet CPU.

Method: rounds; in each round every row runs CALLS calls; per row the median over rounds of the per-call time
(rows interleaved, so a noisy spell hits every row).

Usage: .venv/bin/python bench/host_cpu.py [--rounds 15] [--calls 2000] [--m 1] [--out results.json]
Before/after: run it in a copy of the older commit (`git archive C | tar -x -C DIR`, this file copied into DIR/bench,
`--commit C`) and in this checkout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N, NKV, BLOCKS, BLOCK_SIZE, MAX_POS = 2176, 1, 64, 16, 4096


class _FakeDriver(types.ModuleType):
    """cuda.bindings.driver with the calls that need a GPU answered (CUDA_SUCCESS, a fake value)."""

    def __init__(self, real):
        super().__init__("fake_driver")
        self._real = real
        ok = real.CUresult.CUDA_SUCCESS
        self.cuLibraryLoadData = lambda *a: (ok, "library")
        self.cuLibraryGetKernel = lambda *a: (ok, "kernel")
        self.cuKernelGetFunction = lambda *a: (ok, 0x1000)
        self.cuFuncGetAttribute = lambda *a: (ok, 0)
        self.cuFuncSetAttribute = lambda *a: (ok,)
        self.cuLaunchKernelEx = lambda *a: (ok,)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _no_launch(cfg, func, params, extra):  # the ctypes cuLaunchKernelEx's signature; CUDA_SUCCESS
    return 0


class FakeGpu:
    """Patches for the CPU run (restored by `undo`): see the module docstring for what is stubbed."""

    def __init__(self):
        self._undo = []

    def set(self, obj, name, value):
        had = name in vars(obj) if isinstance(obj, type) else hasattr(obj, name)
        old = getattr(obj, name, None)
        setattr(obj, name, value)
        self._undo.append((obj, name, had, old))

    def on_undo(self, fn):
        self._undo.append(fn)

    def undo(self):
        for u in reversed(self._undo):
            if callable(u):
                u()
                continue
            obj, name, had, old = u
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()


def fake_gpu(launch=_no_launch, encode=None) -> FakeGpu:
    """The patches, made; `launch` stands for libcuda's cuLaunchKernelEx, `encode` for tensormap.encode_2d."""
    import torch

    from musekern.ops import qkv_front as ops
    from musekern.runtime import loader, tensormap
    from musekern.targets import get_target

    f = FakeGpu()
    f.set(torch.Tensor, "is_cuda", property(lambda t: True))
    f.set(torch.Tensor, "get_device", lambda t: 0)
    f.set(torch._C, "_cuda_getCurrentRawStream", abs)
    f.set(loader, "drv", _FakeDriver(loader.drv))
    f.set(loader, "ensure_context", lambda i: None)
    f.set(loader, "device_info", lambda i: {"smem_optin": 227 * 1024})
    f.set(loader, "c_launch_kernel_ex", lambda: launch)
    f.set(tensormap, "encode_2d", encode or (lambda spec, ptr, rows, cols, stride, kernel: bytes(128)))
    h200 = get_target("h200")
    f.set(ops, "_target", lambda device_index: h200)
    loaded = set(loader._LOADED)
    f.on_undo(lambda: forget(loaded))
    return f


def forget(loaded: set) -> None:
    """Drop what the stubbed runs left in the process: kernels loaded since (`loaded`: the keys before) and every
    plan made from them or from the stubbed target."""
    from musekern.ops import qkv_epilogue, qkv_front
    from musekern.runtime import loader

    for key in set(loader._LOADED) - loaded:
        del loader._LOADED[key]
    for mod, names in ((qkv_front, ("_variant", "_fused", "_front_plan", "_path", "_RUNS")),
                       (qkv_epilogue, ("_loaded", "_launcher", "_RUNS"))):
        for name in names:  # (an older commit's set of them, where this script times one)
            got = getattr(mod, name, None)
            if got is not None:
                (got.clear if isinstance(got, dict) else got.cache_clear)()


def loaded_kernel(label: str, abi):
    """A LoadedKernel of `abi` on device 0, made through the stubbed driver (under `fake_gpu`)."""
    from musekern.runtime import loader

    entry = types.SimpleNamespace(key="0" * 64, manifest={"label": label, "symbol": "kern", "abi": abi.to_json()})
    return loader.LoadedKernel(entry, b"", 0)


def load_front(m: int, n: int = N, nkv: int = NKV):
    """The LoadedKernel of the front build (N, m) plans on an H200, its ABI from the kernel module (a real
    manifest's), put where get_kernel finds it."""
    from musekern.kernels.qkv_front.abi import abi_for
    from musekern.ops import qkv_front as ops
    from musekern.runtime import loader

    v = ops._variant(n, m, nkv, 0)
    k = loader._LOADED[(v, 0, None)] = loaded_kernel(v.label, abi_for(v))
    return v, k


def load_qk_norm(m: int = 16, heads: int = 16, head_dim: int = 64, scale: float = 0.125):
    """The qk_norm build an [m, heads * head_dim] bf16 call with `scale` takes, loaded as `load_front` does."""
    from musekern.kernels.qk_norm.abi import abi_for
    from musekern.kernels.qk_norm.variant import qk_norm_variant, qk_norm_vectors
    from musekern.runtime import loader

    v = qk_norm_variant("bfloat16", head_dim, scale, qk_norm_vectors(head_dim, m, heads))
    loader._LOADED[(v, 0, None)] = loaded_kernel(v.label, abi_for(v))
    return v


def inputs(m: int):
    import torch

    from musekern.reference import rope_cos_sin_table

    bf = torch.bfloat16
    kv = torch.zeros(2, BLOCKS, BLOCK_SIZE, NKV, 64, dtype=bf)
    return (torch.randn(m, 8192).to(bf), torch.randn(N, 8192).to(bf), torch.arange(m), rope_cos_sin_table(MAX_POS, 1e6),
            torch.arange(m) * 3, kv[0], kv[1], NKV, 1e-6)


def build_rows(m: int):
    import torch

    import musekern
    from musekern.ops import qkv_front as ops
    from musekern.ops.library import QK_NORM_SCHEMA, QKV_FRONT_SCHEMA

    args = inputs(m)
    y = torch.empty(m, N, dtype=torch.bfloat16)
    # a Library op of the real schema whose CPU kernel is the checked call: the op path's dispatch on CPU tensors
    lib = torch.library.Library("musekern_cpu_probe", "FRAGMENT")
    lib.define("qkv_front" + QKV_FRONT_SCHEMA[QKV_FRONT_SCHEMA.index("("):])
    lib.impl("qkv_front", ops.qkv_front, "CPU")
    lib.define("empty" + QKV_FRONT_SCHEMA[QKV_FRONT_SCHEMA.index("("):])
    lib.impl("empty", lambda *a: y, "CPU")
    lib.define("qk_norm" + QK_NORM_SCHEMA[QK_NORM_SCHEMA.index("("):])
    lib.impl("qk_norm", musekern.qk_norm, "CPU")
    op = torch.ops.musekern_cpu_probe.qkv_front.default
    empty = torch.ops.musekern_cpu_probe.empty.default
    x = args[0]
    load_qk_norm()
    q = torch.randn(16, 2176).to(torch.bfloat16)[:, :1024]  # q heads of a fused row
    qk_op = torch.ops.musekern_cpu_probe.qk_norm.default
    rows = {
        "op (Library, CPU key -> checked qkv_front)": lambda: op(*args),
        "musekern.qkv_front (checked)": lambda: musekern.qkv_front(*args),
        "musekern.qkv_front (checked, out=)": lambda: musekern.qkv_front(*args, out=y),
        "ops.qkv_front.launch (out=)": lambda: ops.launch(*args, out=y),
        "ops.qkv_front.unsupported (checks alone)": lambda: ops.unsupported(*args),
        "empty op (Library, CPU key)": lambda: empty(*args),
        "torch.empty((m, n), dtype, device=x.device)": lambda: torch.empty((m, N), dtype=torch.bfloat16,
                                                                           device=x.device),
        "x.new_empty((m, n))": lambda: x.new_empty((m, N)),
        "x.new_empty(m, n)": lambda: x.new_empty(m, N),
        "op (Library, CPU key -> musekern.qk_norm) [16,1024]": lambda: qk_op(q, 64, 1e-5, 0.125),
        "musekern.qk_norm (checked) [16,1024]": lambda: musekern.qk_norm(q, 64, 1e-5, 0.125),
    }
    rows.update(pieces(ops, args, y, m))
    return rows, lib


def pieces(ops, args, y, m):
    """The launch path's private pieces at the measured commit (a row whose helper a commit lacks is left out)."""
    kernel, grid, run = ops._front_plan(N, m, NKV, 0)
    if getattr(run, "__name__", "") == "<lambda>":  # 0f2834f and before: an eval'd binder of tensors per kernel
        values = run(*args[:7], args[8], y)
        return {"binder (binding alone)": lambda: run(*args[:7], args[8], y),
                "LoadedKernel.launch_ordered (values ready)": lambda: kernel.launch_ordered(grid, list(values))}
    x, w = args[0], args[1]
    ready = ops._all_values(*args[:7], args[8], y)
    ready[:2] = [(w.data_ptr(), *w.shape, w.stride(0)), (x.data_ptr(), *x.shape, x.stride(0))]  # as _fast reads them
    return {"ops.qkv_front._fast (checks alone, dry)": lambda: ops._fast(*args, None, True),
            "ops.qkv_front._all_values (unchecked binding)": lambda: ops._all_values(*args[:7], args[8], y),
            "front launcher (values ready)": lambda: run(list(ready))}


def measure(rows: dict, rounds: int, calls: int) -> dict:
    for fn in rows.values():  # first calls resolve plans, encode maps
        fn()
        fn()
    samples = {k: [] for k in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: {"median_us": statistics.median(v), "min_us": min(v)} for k, v in samples.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the commit of a checkout that is no git tree (`git archive`)")
    a = ap.parse_args(argv)
    fake = fake_gpu()
    try:
        load_front(a.m)
        rows, _lib = build_rows(a.m)
        res = measure(rows, a.rounds, a.calls)
    finally:
        fake.undo()
    from bench.harness.report import commit_info

    doc = {**commit_info(), **({"commit": a.commit} if a.commit else {}),
           "shape": {"N": N, "num_kv_heads": NKV, "M": a.m}, "rounds": a.rounds, "calls": a.calls,
           "python": sys.version.split()[0], "rows": res,
           "command": f"python3 bench/host_cpu.py --m {a.m} --rounds {a.rounds} --calls {a.calls}"}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"host cost per call on this CPU, driver stubbed (commit {str(doc.get('commit'))[:12]}, M={a.m}; "
          f"median of {a.rounds} rounds x {a.calls} calls)")
    for k, r in res.items():
        print(f"{k:50} {r['median_us']:7.2f} us  (min {r['min_us']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
