"""Issue 26's stress: the first step of a torch.compile(mode="reduce-overhead") layer against its eager twin, in many
fresh processes.

Each child process does what the failing processes of the issue did, in order:
  1. inductor, fullgraph, dynamic=True: the op at several M (the fused front and the GEMM path);
  2. mode="reduce-overhead" with the caches passed as arguments (inductor skips CUDA graphs: mutated inputs);
  3. the engine's shape: a module holding its K/V caches as registered buffers, compiled with
     mode="reduce-overhead", fullgraph=True, beside an eager twin; --steps steps, each with fresh x, positions and
     slots; each step's y is cloned at once and compared bit for bit with the twin's, and so are both caches. This
     --trials times a process (torch._dynamo.reset() and a fresh module each time: each first step is a warm-up),
     with eager calls of other shapes between trials and the twin first in every other trial.
Every comparison of every phase is recorded; a child prints one JSON line. Where a y differs, the child says which
tokens and heads and how far each side is from the fp32 reference.

Usage (GPU machine, carried cache):
  python3 bench/first_step_stress.py --procs 60 --parallel 10 --out $OUT/first-step.json
  python3 bench/first_step_stress.py --child [--no-pdl] [--sync-launch]      (one process, for a look)
--no-pdl launches every musekern kernel without programmatic stream serialization; --sync-launch synchronizes the
device before each eager launch (both are diagnostics of the cause, not product switches).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N, NKV, K, D = 2176, 1, 8192, 64  # TP8's shard with one KV head: the fused front serves M <= 64
MAX_POS, BLOCKS, BLOCK = 4096, 9, 16
DYN_MS = tuple(range(1, 301))  # every M the processes ran: the fused front (<= 64) and the GEMM path


def _patch_launcher(no_pdl: bool, sync_launch: bool) -> None:
    import torch

    from musekern.runtime import loader

    base = loader.LoadedKernel.launcher

    def launcher(self, grid, take=None, pdl=None):
        run = base(self, grid, take, False if no_pdl else pdl)
        if not sync_launch:
            return run

        def launch(values, stream=None):
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()
            run(values, stream)

        return launch

    loader.LoadedKernel.launcher = launcher


def child(args) -> dict:
    import torch

    import musekern.ops.library  # noqa: F401  (registers torch.ops.musekern)
    from musekern.reference import qkv_front_reference, rope_cos_sin_table

    if args.no_pdl or args.sync_launch:
        _patch_launcher(args.no_pdl, args.sync_launch)
    op = torch.ops.musekern.qkv_front
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(args.seed)
    W = (torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
    cos_sin = rope_cos_sin_table(MAX_POS, 1e6, dev)
    out: dict = {"seed": args.seed, "phases": {}}

    def inputs(m, nslots=BLOCKS * BLOCK):
        x = torch.randn(m, K, device=dev, generator=g).to(torch.bfloat16)
        pos = torch.randint(0, MAX_POS, (m,), device=dev, generator=g)
        slots = torch.randperm(nslots, device=dev, generator=g)[:m]
        return x, pos, slots

    def caches(blocks=BLOCKS):
        return (torch.zeros(blocks, BLOCK, NKV, D, dtype=torch.bfloat16, device=dev),
                torch.zeros(blocks, BLOCK, NKV, D, dtype=torch.bfloat16, device=dev))

    def fn(x, pos, slots, kc, vc):
        return op(x, W, pos, cos_sin, slots, kc, vc, NKV, 1e-5)

    def twin_calls(call_a, call_b, m, nslots, blocks):
        """y and caches of two calls on the same fresh inputs: equal bit for bit?"""
        x, pos, slots = inputs(m, nslots)
        kc, vc = caches(blocks)
        kc2, vc2 = kc.clone(), vc.clone()
        y = call_a(x, pos, slots, kc, vc).clone()
        y2 = call_b(x, pos, slots, kc2, vc2).clone()
        return torch.equal(y, y2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)

    # 1. inductor, dynamic M (front and GEMM path), compared with eager
    dyn = torch.compile(fn, fullgraph=True, dynamic=True)
    ms = () if args.cold else DYN_MS  # --cold: the layer's first step is the first launch of its kernel
    bad = [m for m in ms if not twin_calls(dyn, fn, m, 64 * BLOCK, 64)]
    out["phases"]["dynamic"] = {"calls": len(ms), "differ_at_m": bad}

    # 2. reduce-overhead with the caches as arguments (CUDA graphs skipped: mutated inputs)
    ro = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    calls = 0 if args.cold else 3
    bad = sum(not twin_calls(ro, fn, args.m, BLOCKS * BLOCK, BLOCKS) for _ in range(calls))
    out["phases"]["reduce_overhead_args"] = {"calls": calls, "differ": bad}

    # 3. the engine's shape: caches as buffers, reduce-overhead, beside an eager twin; TRIALS fresh compiles a
    # process (each one's first step is CUDA-graph trees' warm-up), eager work of other shapes between them, the
    # twin run before the compiled layer in every other trial
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            kc, vc = caches()
            self.register_buffer("kc", kc)
            self.register_buffer("vc", vc)
            if args.engine_layer:  # the weight and the table as an engine holds them: the module's own state
                self.w = torch.nn.Parameter(W.clone(), requires_grad=False)
                self.register_buffer("cs", cos_sin.clone())

        def forward(self, x, pos, slots):
            if args.engine_layer:  # inductor kernels right before the op's PDL launch (both exact: x2, +1)
                return op(x * 2.0, self.w, pos + 1, self.cs, slots, self.kc, self.vc, NKV, 1e-5)
            return op(x, W, pos, cos_sin, slots, self.kc, self.vc, NKV, 1e-5)

    trials = []
    for trial in range(args.trials):
        for m in () if args.cold and trial == 0 else (100, 40, 300):  # other kernels before the layer (cuBLAS +
            fn(*inputs(m, 64 * BLOCK), *caches(64))  # epilogue, another front build)
        torch._dynamo.reset()
        layer, twin = Layer(), Layer()
        compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        twin_first = trial % 2 == (0 if args.twin_first else 1)
        steps = []
        for i in range(args.steps):
            x, pos, slots = inputs(args.m)
            if twin_first:
                y2 = twin(x, pos, slots).clone()
                y = compiled(x, pos, slots).clone()  # at once: the next call may reuse the graph's output memory
            else:
                y = compiled(x, pos, slots).clone()
                y2 = twin(x, pos, slots).clone()
            rec = {"step": i, "y_equal": torch.equal(y, y2), "kc_equal": torch.equal(layer.kc, twin.kc),
                   "vc_equal": torch.equal(layer.vc, twin.vc)}
            if not rec["y_equal"]:
                kc, vc = caches()
                xr, pr = (x * 2.0, pos + 1) if args.engine_layer else (x, pos)
                ref = qkv_front_reference(xr, W, pr, cos_sin, slots, kc, vc, NKV, 1e-5).float()
                diff = (y.float() - y2.float()).abs()
                rec.update(max_abs_diff=float(diff.max()), tokens=diff.amax(1).nonzero().flatten().tolist(),
                           heads=diff.view(args.m, -1, D).amax((0, 2)).nonzero().flatten().tolist(),
                           compiled_err=float((y.float() - ref).abs().max()),
                           eager_err=float((y2.float() - ref).abs().max()))
            if not all((rec["y_equal"], rec["kc_equal"], rec["vc_equal"])):
                steps.append(rec)
        trials.append({"trial": trial, "twin_first": twin_first, "differing_steps": steps})
    out["phases"]["buffer_module"] = trials
    # each compiled layer must have run in CUDA graphs (a skip would make its first step no warm-up)
    out["cudagraph_skips"] = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
    out["first_step_differs"] = sum(any(s["step"] == 0 for s in t["differing_steps"]) for t in trials)
    out["later_step_differs"] = sum(any(s["step"] > 0 for s in t["differing_steps"]) for t in trials)
    ph = out["phases"]
    out["other_differs"] = len(ph["dynamic"]["differ_at_m"]) + ph["reduce_overhead_args"]["differ"]
    return out


def driver(args) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.harness.report import git_state

    flags = [f for f, on in (("--no-pdl", args.no_pdl), ("--sync-launch", args.sync_launch), ("--cold", args.cold),
                             ("--twin-first", args.twin_first),
                             ("--engine-layer", args.engine_layer)) if on]
    running, results, started = [], [], time.time()
    seeds = list(range(args.first_seed, args.first_seed + args.procs))
    while seeds or running:
        while seeds and len(running) < args.parallel:
            seed = seeds.pop(0)
            env = dict(os.environ)
            if args.fresh_inductor_cache:  # a cold compile in every process, as on a new machine
                env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"ind{seed}-")
            cmd = [sys.executable, __file__, "--child", "--seed", str(seed), "--m", str(args.m), "--trials",
                   str(args.trials), "--steps", str(args.steps), *flags]
            running.append((seed, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                   env=env)))
        time.sleep(0.5)
        for seed, p in list(running):
            if p.poll() is None:
                continue
            running.remove((seed, p))
            so, se = p.communicate()
            line = next((ln for ln in reversed(so.splitlines()) if ln.startswith("{")), None)
            rec = json.loads(line) if p.returncode == 0 and line else \
                {"seed": seed, "error": f"exit {p.returncode}: {se.strip().splitlines()[-1:] if se.strip() else ''}"}
            results.append(rec)
            if "error" in rec:
                what = "ERROR " + rec["error"]
            else:
                what = (f"first steps differ in {rec['first_step_differs']}/{args.trials} trials, later steps in "
                        f"{rec['later_step_differs']}, other phases {rec['other_differs']}")
            print(f"seed {seed}: {what}", file=sys.stderr, flush=True)
    import torch

    ok = [r for r in results if "error" not in r]
    summary = {"processes": len(results), "errors": len(results) - len(ok),
               "first_steps": len(ok) * args.trials,
               "first_step_differs": sum(r["first_step_differs"] for r in ok),
               "later_step_differs": sum(r["later_step_differs"] for r in ok),
               "other_differs": sum(r["other_differs"] for r in ok),
               "m": args.m, "n": N, "num_kv_heads": NKV, "trials": args.trials, "steps": args.steps,
               "parallel": args.parallel,
               "fresh_inductor_cache": args.fresh_inductor_cache, "flags": flags,
               "seconds": round(time.time() - started, 1)}
    doc = {"what": "issue 26: first step of a reduce-overhead layer vs its eager twin, fresh processes",
           **git_state(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "summary": summary, "processes": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    cols = ("processes", "errors", "first_steps", "first_step_differs", "later_step_differs", "other_differs",
            "seconds")
    print("  ".join(cols) + "  flags")
    print("  ".join(f"{summary[c]:>{len(c)}}" for c in cols) + f"  {' '.join(flags) or '-'}")
    bad = summary["first_step_differs"] + summary["later_step_differs"] + summary["other_differs"]
    return 1 if bad or summary["errors"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help="run one process's scenario and print its JSON line")
    ap.add_argument("--procs", type=int, default=50)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--trials", type=int, default=6, help="fresh compiles of the buffer module a process")
    ap.add_argument("--steps", type=int, default=3, help="steps of each compiled module (the first: warm-up)")
    ap.add_argument("--cold", action="store_true", help="no op call before the first trial's first step")
    ap.add_argument("--twin-first", action="store_true", help="the eager twin before the compiled layer in trial 0")
    ap.add_argument("--engine-layer", action="store_true",
                    help="the layer holds its weight and cos|sin table, and inductor kernels feed the op's x and "
                         "positions (x * 2, positions + 1: exact, so the eager twin stays bit-comparable)")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--sync-launch", action="store_true")
    ap.add_argument("--fresh-inductor-cache", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
