#!/usr/bin/env python3
"""Where a qkv_front layer's time goes around the PDL boundary: timestamps inside the real kernel.

The skeleton probe (skeleton_probe.py) bounds the chain by what streams before griddepcontrol.wait; the front
then runs 0.7-1.1 us slower than its skeleton (bench/HISTORY.md round 16b), which was put down to its tail (last
MMAs, cluster exchange, epilogue) without a measurement. This probe builds the planned kernels with a
subclass that adds %globaltimer / %clock64 stamps at the warp roles' boundaries (the math, the ABI and the
launch are the kernel's own) and writes them into rows of y the launch leaves unwritten (rows M..TT-1 of the
padded token tile: M = 1 with one tile, M = 9 with two, TT - 7 with more). Per CTA, 8 stamps (slot k: globaltimer;
8 + k: clock64):

  0 producer start (after init and the cluster sync)    4 consumer warp 0: partials sent (send / reduce_send)
  1 aux warp: griddepcontrol.wait returned               5 warp 0: all partials of its tokens landed (owner)
  2 producer: last load issued (and "late" triggered)    6 warp 0: epilogue done (its stores issued)
  3 consumer warp 0: last k-tile consumed                7 consumer warp 3: last k-tile consumed

and in slots 16 / 17 the kernel's entry (thread 0, before the barriers' init and the cluster sync), in slot 18 the
SM the CTA ran on (%smid), in slots 19 / 20 consumer thread 0 past `ring_idle` (with `recv_in_ring` the cluster
barrier before the sends): the wgmma builds' 136 CTAs leave 4 or more of the 132 SMs with two CTAs of the grid, and
the per-SM columns compare those CTAs with the ones alone on their SM.

Modes: chain (the fronts back to back, PDL), after-norm (per layer the bench's PDL RMSNorm predecessor, then
the front; the predecessor is rebuilt with three globaltimer stamps: its CTA started and triggered, its
griddepcontrol.wait returned, its stores issued), after-norm-l2 (the same with the predecessor's input in L2)
and isolated (no PDL).

Build here (CPU, nvidia-cutlass-dsl):  python bench/probes/tail_trace.py build DIR [CASE ...]
Run on the GPU (carry DIR):           python3 bench/probes/tail_trace.py run DIR OUT.json
"""
# (no `from __future__ import annotations`: @cute.kernel reads real annotation objects)

import json
import os
import statistics
import sys

LAYERS = 8
SLOTS = 21  # per CTA: 8 globaltimer stamps, the same 8 as clock64, the kernel's entry (globaltimer, clock64), %smid,
# consumer thread 0 past ring_idle (globaltimer, clock64: the receive buffer's cluster barrier with recv_in_ring)
STAMPS = ("prod_start", "wait_ret", "prod_end", "cons_done", "sent", "recv", "epi_done", "cons3_done")
# (name, variant label overrides of the planned TP8 / TP4 builds, M)
# (the planned TP8 builds fire trigger_ahead = stages k-tiles before the last load; "deep" is round 19's 11-stage
# ring, the fastest chain and a slower after-norm)
CASES = [("tp8-m1-plan", dict(n=2176, m=1), {}), ("tp8-m1-last", dict(n=2176, m=1), {"trigger_ahead": 0}),
         ("tp8-m9-plan", dict(n=2176, m=9), {}), ("tp4-m1-exit", dict(n=4352, m=1), {}),
         ("tp8-m1-deep6", dict(n=2176, m=1), {"stages": 11, "trigger_ahead": 6}),
         ("tp8-m1-deep11", dict(n=2176, m=1), {"stages": 11, "trigger_ahead": 11}),
         ("tp8-m1-deep8", dict(n=2176, m=1), {"stages": 11, "trigger_ahead": 8}),
         ("tp2-m1-plan", dict(n=8704, m=1), {}), ("tp2-m9-plan", dict(n=8704, m=9), {}),
         ("tp1-m1-plan", dict(n=17408, m=1), {}), ("tp1-m9-plan", dict(n=17408, m=9), {}),
         # above 16 tokens (round 39): the tile steps at TP4 and TP8 (M = TT - 7: 7 rows of y left for the stamps)
         ("tp4-m9-plan", dict(n=4352, m=9), {}), ("tp4-m25-plan", dict(n=4352, m=25), {}),
         ("tp4-m41-plan", dict(n=4352, m=41), {}), ("tp4-m57-plan", dict(n=4352, m=57), {}),
         ("tp8-m25-plan", dict(n=2176, m=25), {}), ("tp8-m41-plan", dict(n=2176, m=41), {}),
         ("tp8-m57-plan", dict(n=2176, m=57), {})]
KV = {2176: 1, 4352: 2, 8704: 4, 17408: 8}


def trace_row(v) -> int:
    """First y row the launch leaves unwritten: the M the probe runs with (1 with one tile, 9 with two, 7 rows short of
    the padded tokens above: room for 136 CTAs' stamps at N >= 2176)."""
    return 1 if v.tiles == 1 else 9 if v.tiles == 2 else v.tiles * 8 - 7


def _variant(n, m, overrides):
    import dataclasses

    from musekern.kernels.qkv_front.rules import variant
    from musekern.targets import get_target

    return dataclasses.replace(variant(n, m, KV[n], get_target("h200")), **overrides)


# ---------------------------------------------------------------------------------------------- build (CPU)
def _jit_copy(kernel_method):
    """A @cute.jit copy of a @cute.kernel method's undecorated body, to be traced inline inside another kernel
    (a copy: the DSL keeps its decoration state on the function object the product kernel still uses)."""
    import types

    import cutlass.cute as cute

    raw = kernel_method.__wrapped__
    fn = types.FunctionType(getattr(raw, "_original_code", raw.__code__), raw.__globals__, raw.__name__,
                            raw.__defaults__, raw.__closure__)
    fn.__qualname__, fn.__module__, fn.__annotations__ = raw.__qualname__, raw.__module__, dict(raw.__annotations__)
    return cute.jit(fn)


def _traced_class():
    """The front's kernel class with its entry and warp roles wrapped in timestamps (the product kernel has no
    hooks: the traced `kernel` stamps the entry, then runs the product kernel's own body)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    from musekern.kernels.qkv_front.kernel import QkvFrontKernel

    @dsl_user_op
    def _read(reg, *, loc=None, ip=None):
        return Int64(llvm.inline_asm(Int64.mlir_type, [], f"mov.u64 $0, {reg};", "=l", has_side_effects=True,
                                     asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @dsl_user_op
    def _smid(*, loc=None, ip=None):
        return cutlass.Int32(llvm.inline_asm(cutlass.Int32.mlir_type, [], "mov.u32 $0, %smid;", "=r",
                                             has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
                                             ip=ip))

    base = QkvFrontKernel
    body = _jit_copy(base.kernel)

    class TracedFront(base):
        def _stamp(self, k: int, cond):
            self._stamp_slots(k, 8 + k, cond)

        @cute.jit
        def _stamp_slots(self, gt_slot: int, clk_slot: int, cond):
            tr = self._tr
            base_slot = cute.arch.block_idx()[0] * SLOTS
            if cond:
                tr[base_slot + gt_slot] = _read("%globaltimer")
                tr[base_slot + clk_slot] = _read("%clock64")

        @cute.jit
        def _stamp_sm(self, cond):
            tr = self._tr
            slot = cute.arch.block_idx()[0] * SLOTS + 18
            if cond:
                tr[slot] = Int64(_smid())

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW_tma: cute.Tensor, tma_x: cute.CopyAtom, mX_tma: cute.Tensor,
                   w_ptr: cute.Pointer, y_ptr: cute.Pointer, pos_ptr: cute.Pointer, cs_ptr: cute.Pointer,
                   slot_ptr: cute.Pointer, kc_ptr: cute.Pointer, vc_ptr: cute.Pointer, max_pos: cutlass.Int32,
                   block_size: cutlass.Int32, num_blocks: cutlass.Int32, k_block_stride: cutlass.Int64,
                   v_block_stride: cutlass.Int64, eps: cutlass.Float32, tiled_mma: cute.TiledMma,
                   sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout):
            # the stamps go to rows of y the launch leaves unwritten
            self._tr = cute.make_tensor(cute.recast_ptr(y_ptr + trace_row(self.v) * self.n, dtype=Int64),
                                        cute.make_layout(self.heads * self.k_split * SLOTS))
            self._stamp_slots(16, 17, cute.arch.thread_idx()[0] == 0)  # before the barriers' init, the cluster sync
            self._stamp_sm(cute.arch.thread_idx()[0] == 0)
            body(self, tma_w, mW_tma, tma_x, mX_tma, w_ptr, y_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr,
                 max_pos, block_size, num_blocks, k_block_stride, v_block_stride, eps, tiled_mma, sW_layout,
                 sX_layout)

        @cute.jit
        def producer(self, tma_w, mW_tma, tma_x, mX_tma, sW, sX, full, empty, place):
            self._stamp(0, cute.arch.lane_idx() == 0)
            base.producer(self, tma_w, mW_tma, tma_x, mX_tma, sW, sX, full, empty, place)
            self._stamp(2, cute.arch.lane_idx() == 0)

        @cute.jit
        def ring_idle(self):
            base.ring_idle(self)
            self._stamp_slots(19, 20, cute.arch.thread_idx()[0] == 0)

        @cute.jit
        def aux(self, st, pos_ptr, cs_ptr, slot_ptr, M, max_pos, place):
            cute.arch.griddepcontrol_wait()
            self._stamp(1, cute.arch.lane_idx() == 0)
            base.aux(self, st, pos_ptr, cs_ptr, slot_ptr, M, max_pos, place)

        def _consumed(self, tidx):
            self._stamp(3, tidx == 0)  # consumer warp 0 (thread 0) and warp 3 (thread 96) past their last k-tile
            self._stamp(7, tidx == 96)

        @cute.jit
        def consumer(self, tiled_mma, sW, sX, full, empty, tidx, place, wq=None):
            acc = base.consumer(self, tiled_mma, sW, sX, full, empty, tidx, place, wq)
            self._consumed(tidx)
            return acc

        @cute.jit
        def consumer_wg(self, tiled_mma, sW, sX, full, empty, tidx, place):
            acc = base.consumer_wg(self, tiled_mma, sW, sX, full, empty, tidx, place)
            self._consumed(tidx)
            return acc

        @cute.jit
        def consumer_k(self, tiled_mma, sW, sX, full, empty, warp_idx, lane, place, wq=None):
            acc = base.consumer_k(self, tiled_mma, sW, sX, full, empty, warp_idx, lane, place, wq)
            self._stamp(3, warp_idx == 0 and lane == 0)
            self._stamp(7, warp_idx == 3 and lane == 0)
            return acc

        @cute.jit
        def send(self, tiled_mma, acc, st, recv_bar, tidx, place, wq=None):
            base.send(self, tiled_mma, acc, st, recv_bar, tidx, place, wq)
            self._stamp(4, tidx == 0)

        @cute.jit
        def reduce_send(self, tiled_mma, acc, st, recv_bar, warp_idx, tidx, place, wq=None):
            base.reduce_send(self, tiled_mma, acc, st, recv_bar, warp_idx, tidx, place, wq)
            self._stamp(4, tidx == 0)

        @cute.jit
        def finish(self, st, recv_bar, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
                   v_block_stride, eps, place, warp_idx, tidx, scales):
            if cutlass.const_expr(self.k_split > 1):
                cute.arch.mbarrier_wait(recv_bar, 0)  # what finish waits for first (a second wait returns at once)
            self._stamp(5, tidx == 0)
            base.finish(self, st, recv_bar, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
                        v_block_stride, eps, place, warp_idx, tidx, scales)
            self._stamp(6, tidx == 0)

    return TracedFront


def compile_traced(v):
    """cubin, PTX, symbol and ABI of the traced build of v (its PTX `.entry` checked against the front's ABI)."""
    from musekern.builder.compile import CompiledKernel
    from musekern.builder.dsl import compile_to_cubin
    from musekern.kernels.qkv_front.abi import abi_for
    from musekern.kernels.qkv_front.kernel import compile_args
    from musekern.store.abi import check_abi_against_ptx

    cubin, ptx, symbol = compile_to_cubin(_traced_class()(v), *compile_args(v), arch="sm_90a")
    abi = abi_for(v)
    check_abi_against_ptx(abi, ptx, symbol)
    return CompiledKernel(symbol=symbol, cubin=cubin, ptx=ptx, abi=abi)


def build(outdir: str, names=()) -> None:
    from bench.harness.report import git_state

    known = [c[0] for c in CASES]
    if unknown := sorted(set(names) - set(known)):
        raise SystemExit(f"unknown case(s) {unknown}; known: {known}")
    os.makedirs(outdir, exist_ok=True)
    manifest = []
    for name, shape, overrides in CASES:
        if names and name not in names:
            continue
        v = _variant(shape["n"], shape["m"], overrides)
        ck = compile_traced(v)
        open(os.path.join(outdir, f"{name}.cubin"), "wb").write(ck.cubin)
        manifest.append({"name": name, "label": v.label, "m": trace_row(v), "symbol": ck.symbol,
                         "abi": ck.abi.to_json()})
        print(f"built {name}: {v.label}", file=sys.stderr)
    json.dump({**git_state(), "cases": manifest}, open(os.path.join(outdir, "manifest.json"), "w"), indent=1)


# ---------------------------------------------------------------------------------------------- run (GPU)
PRED_STAMPS = ("pred_start", "pred_wait", "pred_end")
# after-norm: each layer's predecessor reads its own residual (evicted from L2 by the weight stream: from HBM, as
# the bench's); after-norm-l2: all read one residual, which stays in L2 (as an engine's norm reads the residual
# its previous kernel just wrote)
MODES = ("chain", "after-norm", "after-norm-l2", "isolated")


def traced_pred_source() -> str:
    """The bench's predecessor with globaltimer stamps (thread 0 of each CTA, 4 slots per CTA): after its
    launch_dependents, after its griddepcontrol.wait, after the CTA's stores (a barrier first)."""
    from bench.harness.pred import SOURCE

    def sub(old, new):
        assert SOURCE.count(old) == 1, old
        return new

    gt = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));'
    edits = [("uint4* __restrict__ x, float eps) {", "uint4* __restrict__ x, float eps, unsigned long long* tr) {"
              "\n    unsigned long long t_;"),
             ('asm volatile("griddepcontrol.launch_dependents;" ::: "memory");',
              'asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n    ' + gt +
              "\n    if (threadIdx.x == 0) tr[blockIdx.x * 4 + 0] = t_;"),
             ('asm volatile("griddepcontrol.wait;" ::: "memory");',
              'asm volatile("griddepcontrol.wait;" ::: "memory");\n    ' + gt +
              "\n    if (threadIdx.x == 0) tr[blockIdx.x * 4 + 1] = t_;"),
             ("        x[row + i * 256 + t] = o;\n    }\n}",
              "        x[row + i * 256 + t] = o;\n    }\n    __syncthreads();\n    " + gt +
              "\n    if (threadIdx.x == 0) tr[blockIdx.x * 4 + 2] = t_;\n}")]
    src = SOURCE
    for old, new in edits:
        src = src.replace(old, sub(old, new))
    return src


def _traced_pred():
    import ctypes

    from bench.harness.pred import HIDDEN, SYMBOL, THREADS, PredKernel, _BuiltKernel

    class TracedPred(PredKernel):
        def __init__(self):
            _BuiltKernel.__init__(self, "sm_90a", traced_pred_source(), "pred_traced.cu", SYMBOL)

        def launch(self, res, gamma, x, eps, tr, pdl=True):
            m = res.shape[0]
            assert res.shape == x.shape == (m, HIDDEN) and tr.numel() >= 4 * m
            vals = self.params(res, gamma, x, eps) + [ctypes.c_uint64(tr.data_ptr())]
            self._launch((m, 1, 1), (THREADS, 1, 1), vals, pdl, "cuLaunchKernelEx(traced pred)")

    return TracedPred()


class _Entry:
    def __init__(self, m):
        self.key = m["name"]
        self.manifest = {"label": m["label"], "symbol": m["symbol"], "abi": m["abi"]}


def _layer_summary(st):
    """st: [ctas, SLOTS] int64 stamps of one launch -> ns (globaltimer) relative to the first producer start,
    and per-CTA intra-SM durations in cycles (clock64)."""
    g = st[:, :8].double()
    c = st[:, 8:16].double()
    entry = st[:, 16].double()
    t0 = g[:, 0].min()
    out = {f"{s}_{f}": round(float(fn(g[:, i]) - t0), 1) for i, s in enumerate(STAMPS)
           for f, fn in (("min", lambda x: x.min()), ("max", lambda x: x.max()))}
    # every CTA runs the epilogue (an owner of only padded tokens stores nothing), so every row has all stamps
    out["cyc_consume_to_sent_med"] = float((c[:, 4] - c[:, 3]).median())
    out["cyc_sent_to_recv_med"] = float((c[:, 5] - c[:, 4]).median())
    out["cyc_recv_to_epi_med"] = float((c[:, 6] - c[:, 5]).median())
    out["cyc_cons_to_epi_max"] = float((c[:, 6] - c[:, 3]).max())
    # per CTA: producer start -> last k-tile consumed (the stream, with any wait), -> epilogue done (the tail)
    out["cyc_start_to_cons_med"] = float((c[:, 3] - c[:, 0]).median())
    out["cyc_cons_to_epi_med"] = float((c[:, 6] - c[:, 3]).median())
    out["ns_wait_to_cons_med"] = float((g[:, 3] - g[:, 1]).median())
    # the prologue: kernel entry -> producer start (barrier init, cluster sync)
    out["cyc_entry_to_start_med"] = float((c[:, 0] - st[:, 17].double()).median())
    out["cyc_entry_to_start_max"] = float((c[:, 0] - st[:, 17].double()).max())
    # per SM (slot 18): CTAs that share their SM with another CTA of this grid against those alone on theirs
    sm = st[:, 18].tolist()
    shared = [sm.count(x) > 1 for x in sm]
    out["ctas_sharing_sm"] = sum(shared)
    for tag, sel in (("shared", [i for i, f in enumerate(shared) if f]), ("alone", [i for i, f in enumerate(shared)
                                                                                  if not f])):
        if sel:
            out[f"cons_done_med_{tag}"] = round(float(g[sel, 3].median() - t0), 1)
            out[f"cons_done_max_{tag}"] = round(float(g[sel, 3].max() - t0), 1)
            out[f"cyc_start_to_cons_med_{tag}"] = float((c[sel, 3] - c[sel, 0]).median())
    if bool((st[:, 20] != 0).all()):  # the consumers pass ring_idle in the wgmma builds only
        out["cyc_cons_to_idle_med"] = float((st[:, 20].double() - c[:, 3]).median())  # the ring_idle barrier
        out["cyc_idle_to_sent_med"] = float((c[:, 4] - st[:, 20].double()).median())  # the sends
    last = int(g[:, 6].argmax())
    out["last_epi_cta_shares_sm"] = shared[last]
    out["_abs"] = {"t0": float(t0), "epi_done_max": float(g[:, 6].max()), "wait_ret_min": float(g[:, 1].min()),
                   "wait_ret_max": float(g[:, 1].max()), "prod_start_min": float(g[:, 0].min()),
                   "prod_end_max": float(g[:, 2].max()), "cons_done_max": float(g[:, 3].max()),
                   "entry_min": float(entry.min())}
    return out


def run(outdir: str, out_json: str) -> int:
    import torch

    from bench.harness.timing import Graph, time_graphs
    from musekern.kernels.qkv_front.variant import HIDDEN, launch_grid, padded_tokens
    from musekern.ops.qkv_front import launch_args
    from musekern.plan import variant_from_label
    from musekern.runtime.loader import LoadedKernel

    man = json.load(open(os.path.join(outdir, "manifest.json")))
    torch.zeros(1, device="cuda")  # the primary context, current: the predecessor loads its module into it
    pred = _traced_pred()
    results = []
    for m in man["cases"]:
        v = variant_from_label(m["label"])
        M = m["m"]
        k = LoadedKernel(_Entry(m), open(os.path.join(outdir, f"{m['name']}.cubin"), "rb").read(),
                         torch.cuda.current_device())
        weights = [(torch.randn(v.n, HIDDEN, device="cuda") / 90).to(torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(M, HIDDEN, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 4096, (M,), device="cuda")
        cs = torch.randn(4096, 64, device="cuda")
        slots = torch.randperm(64 * 16, device="cuda")[:M]
        kv = torch.zeros(2, 64, 16, v.num_kv_heads, 64, dtype=torch.bfloat16, device="cuda")
        ys = [torch.zeros(padded_tokens(v), v.n, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        grid = launch_grid(v)
        res = [torch.randn(M, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        gamma = (1 + torch.randn(HIDDEN, device="cuda") / 8).to(torch.bfloat16)
        xs = [torch.empty(M, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        ptr = [torch.zeros(4 * M, dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
        case = {"name": m["name"], "label": m["label"], "M": M}
        for mode in MODES:
            launches = []
            norm = mode.startswith("after-norm")
            for j, (w, y) in enumerate(zip(weights, ys, strict=True)):
                a = launch_args(xs[j] if norm else x, w, pos, cs, slots, kv[0], kv[1], 1e-5, y[:M])
                if norm:
                    r = res[0] if mode == "after-norm-l2" else res[j]
                    launches.append(lambda r=r, xj=xs[j], t=ptr[j], g=gamma: pred.launch(r, g, xj, 1e-5, t))
                launches.append(lambda a=a, k=k, grid=grid, pdl=mode != "isolated": k.launch(grid, a, pdl=pdl))
            g = Graph(mode, launches, 1, LAYERS)
            us = time_graphs([g], 5)[mode]["us"]
            g.replay()  # the stamps of this replay are read below
            torch.cuda.synchronize()
            ctas = v.heads * v.k_split
            layers, raw = [], None
            for j, y in enumerate(ys):
                st = y[M:].contiguous().view(torch.int64).flatten()[: ctas * SLOTS].view(ctas, SLOTS).cpu()
                layers.append(_layer_summary(st))
                if j == LAYERS // 2:  # one middle layer per CTA, ns from the previous layer's last epilogue
                    e = layers[j - 1]["_abs"]["epi_done_max"]
                    raw = [[round(float(t) - e) if t else None  # slot 19: 0 where the consumers skip ring_idle
                            for t in row[:8].tolist() + [row[16].item(), row[19].item()]] for row in st]
            # across the PDL boundary: from layer i's last epilogue to layer i+1's first wait return / start
            gaps = [_gap(a, b) for a, b in zip(layers, layers[1:], strict=False)]
            if norm:  # the predecessor between them (its CTA 0), from the same last epilogue
                for gp, a, p in zip(gaps, layers, ptr[1:], strict=False):
                    t = p.view(M, 4)[0].cpu().tolist()
                    for name, ti in zip(PRED_STAMPS, t, strict=False):
                        gp[f"{name}_minus_epi_done"] = round(ti - a["_abs"]["epi_done_max"], 1)
            case[mode] = {"us_per_layer": round(us, 3), "layers": layers, "gaps": gaps, "raw_mid_layer": raw}
        results.append(case)
        print(json.dumps({"name": case["name"], **{f"{md}_us": case[md]["us_per_layer"]
                                                    for md in MODES}}), file=sys.stderr)
    json.dump({"commit": man["commit"], "dirty": man["dirty"], "device": torch.cuda.get_device_name(),
               "command": "python3 bench/probes/tail_trace.py run " + " ".join(sys.argv[2:]), "cases": results},
              open(out_json, "w"), indent=1)
    _table(results)
    _cta_table(results)
    _sm_table(results)
    return 0


def _gap(a, b) -> dict:
    """Layer a's last epilogue against layer b's first producer start / first wait return, ns."""
    e = a["_abs"]["epi_done_max"]
    return {"next_start_min_minus_epi_done": round(b["_abs"]["prod_start_min"] - e, 1),
            "next_entry_min_minus_epi_done": round(b["_abs"]["entry_min"] - e, 1),
            "next_wait_ret_min_minus_epi_done": round(b["_abs"]["wait_ret_min"] - e, 1),
            "next_wait_spread": round(b["_abs"]["wait_ret_max"] - b["_abs"]["wait_ret_min"], 1),
            "next_stream": round(b["_abs"]["cons_done_max"] - b["_abs"]["wait_ret_min"], 1),
            "layer_period": round(b["_abs"]["epi_done_max"] - e, 1)}


def _med(xs):
    return round(statistics.median(xs), 0)


def _table(results):
    """Medians over the layers of one replay (ns from the layer's first producer start; cycles at 1.98 GHz;
    gap columns from the previous layer's last epilogue; stream: first wait return to last k-tile consumed)."""
    print(f"{'case':16} {'mode':13} {'us/lay':>6} {'wait':>6} {'prodend':>7} {'consdn':>7} {'epidone':>7} "
          f"{'c->sent':>7} {'s->recv':>7} {'r->epi':>7} {'gap->wait':>9} {'start-epi':>9} {'stream':>7} {'period':>7}")
    for c in results:
        for mode in MODES:
            L, G = c[mode]["layers"], c[mode]["gaps"]
            print(f"{c['name']:16} {mode:13} {c[mode]['us_per_layer']:6.2f} "
                  f"{_med([x['wait_ret_max'] for x in L]):6.0f} "
                  f"{_med([x['prod_end_max'] for x in L]):7.0f} {_med([x['cons_done_max'] for x in L]):7.0f} "
                  f"{_med([x['epi_done_max'] for x in L]):7.0f} "
                  f"{_med([x['cyc_consume_to_sent_med'] for x in L]):7.0f} "
                  f"{_med([x['cyc_sent_to_recv_med'] for x in L]):7.0f} "
                  f"{_med([x['cyc_recv_to_epi_med'] for x in L]):7.0f} "
                  f"{_med([x['next_wait_ret_min_minus_epi_done'] for x in G]):9.0f} "
                  f"{_med([x['next_start_min_minus_epi_done'] for x in G]):9.0f} "
                  f"{_med([x['next_stream'] for x in G]):7.0f} "
                  f"{_med([x['layer_period'] for x in G]):7.0f}")
            if mode.startswith("after-norm"):
                print(f"{'':16} {'  pred':13} " + "  ".join(
                    f"{n}-epi {_med([x[n + '_minus_epi_done'] for x in G]):6.0f}" for n in PRED_STAMPS))


def _cta_table(results):
    """Per CTA, medians over CTAs then layers: the stream (start -> last k-tile consumed, cycles; wait return ->
    last k-tile consumed, ns) and the tail (last k-tile consumed -> epilogue done, cycles)."""
    print(f"{'case':16} {'mode':13} {'start->cons cyc':>15} {'wait->cons ns':>13} {'cons->epi cyc':>13} "
          f"{'entry->start cyc med / max':>26}")
    for c in results:
        for mode in MODES:
            L = c[mode]["layers"]
            print(f"{c['name']:16} {mode:13} {_med([x['cyc_start_to_cons_med'] for x in L]):15.0f} "
                  f"{_med([x['ns_wait_to_cons_med'] for x in L]):13.0f} "
                  f"{_med([x['cyc_cons_to_epi_med'] for x in L]):13.0f} "
                  f"{_med([x['cyc_entry_to_start_med'] for x in L]):13.0f} / "
                  f"{_med([x['cyc_entry_to_start_max'] for x in L]):10.0f}")


def _sm_table(results):
    """CTAs that share their SM with another CTA of the grid against those alone on theirs: when their last k-tile
    is consumed (ns from the layer's first producer start, median / max over the group, medians over layers), their
    stream in cycles, and in how many layers the CTA whose epilogue ends last shares its SM."""
    print(f"{'case':16} {'mode':13} {'shared':>6} {'cons med sh/al':>15} {'cons max sh/al':>15} "
          f"{'start->cons cyc sh/al':>22} {'last shares':>11} {'c->idle':>7} {'idle->sent':>10}")
    for c in results:
        for mode in MODES:
            L = c[mode]["layers"]

            def m(key, L=L):
                xs = [x[key] for x in L if key in x]
                return f"{_med(xs):.0f}" if xs else "-"
            print(f"{c['name']:16} {mode:13} {m('ctas_sharing_sm'):>6} "
                  f"{m('cons_done_med_shared') + ' / ' + m('cons_done_med_alone'):>15} "
                  f"{m('cons_done_max_shared') + ' / ' + m('cons_done_max_alone'):>15} "
                  f"{m('cyc_start_to_cons_med_shared') + ' / ' + m('cyc_start_to_cons_med_alone'):>22} "
                  f"{sum(x['last_epi_cta_shares_sm'] for x in L):>6} of {len(L)} {m('cyc_cons_to_idle_med'):>7} "
                  f"{m('cyc_idle_to_sent_med'):>10}")


def main(argv) -> int:
    if len(argv) >= 2 and argv[0] == "build":
        build(argv[1], argv[2:])
        return 0
    if len(argv) == 3 and argv[0] == "run":
        return run(argv[1], argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
