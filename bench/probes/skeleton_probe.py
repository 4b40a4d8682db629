#!/usr/bin/env python3
"""qkv_front's memory skeleton without the math: how fast can the weights stream per layer when the
consumers need x (written by the previous kernel) from the first k-tile on?

The team's PDL probe (../shared/anchors/pdl-probe) streamed every weight byte BEFORE griddepcontrol.wait
(its consumers needed the predecessor's output only for the final store) and reached 98% of copy bandwidth
at TP8 with fronts back to back; issue 5's targets come from it. The real front's MMA needs x from k-tile 0,
so before the wait a CTA can only fill its ring. This probe runs both dependency modes on the front's
exact skeleton (clusters of S CTAs per head, `stages` x (16 KiB W + 2 KiB x) TMA ring with 128B swizzle,
4 consumer warps + 1 producer warp, k_rotate 1), with the math replaced by two smem reads per stage:

  mode "after": W streams with no wait; every thread waits (griddepcontrol.wait) only before the store
                (the anchor probe's dependency);
  mode "before": the producer prefills the ring with W, waits, then loads x per stage; the consumers wait
                before their first stage (the real front's dependency).

Build here (CPU, nvidia-cutlass-dsl):  python bench/probes/skeleton_probe.py build DIR [planned|stash|ahead]
Run on the GPU (carry DIR):           python3 bench/probes/skeleton_probe.py run DIR OUT.json [NAME-PREFIX]
"""
# (no `from __future__ import annotations`: @cute.struct reads real annotation objects)

import json
import os
import sys
from dataclasses import asdict, dataclass

HIDDEN, HEAD_COLS, K_TILE = 8192, 64, 128
W_STAGE = HEAD_COLS * K_TILE * 2
THREADS = 160  # warps 0-3 consumers, warp 4 producer
LAYERS = 8


@dataclass(frozen=True)
class ProbeConfig:
    name: str
    heads: int
    k_split: int
    stages: int
    mode: str  # "after" | "before"
    trigger: str  # "early" | "late" | "exit"
    tt: int = 8  # x rows per stage: 8 (one token tile) or 16 (two)
    # mode "before" only: k-tiles the consumers take before the wait (their W, as a register stash would
    # hold it) and release, so the producer refills their slots before x exists; their x is loaded after
    # the wait into a separate area. 0 = the front as built.
    stash: int = 0
    # trigger "late" only: trigger after issuing the load of k-tile ntiles - 1 - ahead (0 = the last one);
    # any point past the ring prefill keeps at most two grids resident (the next one cannot pass its own
    # trigger before this one completes)
    ahead: int = 0
    # the K streamed: 4096 bf16 columns a row move the bytes of 8192 e4m3 ones (issue 30's e4m3 weights), in half
    # as many 16 KiB stages on the same grid (x then moves half the real front's bytes a CTA, from the L2)
    hidden: int = HIDDEN

    @property
    def ntiles(self) -> int:
        """The k-tiles a CTA streams."""
        return self.hidden // K_TILE // self.k_split

    def __post_init__(self):
        ntiles = self.ntiles
        if self.stash and self.mode != "before":
            raise ValueError(f"{self.name}: stash needs mode 'before'")
        if self.ahead and not (self.trigger == "late" and self.stages + self.stash <= ntiles - 1 - self.ahead):
            raise ValueError(f"{self.name}: ahead needs trigger 'late' and a trigger tile past the prefill")


# the planned shapes of the default model on the H200 (musekern plan --target h200), both modes; and TP1's
# deep ring under the real dependency with one and two token tiles of x per stage (is the two-tile builds'
# 6% at TP1 in the memory structure?)
CONFIGS = [ProbeConfig(f"tp{tp}-{mode}-{trig}", heads, s, st, mode, trig)
           for tp, heads, s, st, trigs in ((8, 34, 2, 5, ("late", "early")), (4, 68, 2, 4, ("exit", "early")),
                                           (2, 136, 1, 4, ("late", "early")))
           for mode in ("after", "before") for trig in trigs] \
    + [ProbeConfig(f"tp1-before-early-st{st}-tt{tt}", 272, 1, st, "before", "early", tt)
       for st, tt in ((11, 8), (8, 8), (8, 16))]

# round 16: what a register stash (k-tiles taken before x exists) and an earlier late trigger are worth under
# the real dependency; TP8 also with one CTA per head (S = 1) and the deep ring, where three layers' grids fit
STASH_CONFIGS = [ProbeConfig(f"tp8-st5-stash{t}", 34, 2, 5, "before", "late", stash=t) for t in (0, 2, 4, 8)] \
    + [ProbeConfig(f"tp8-st5-ahead{a}", 34, 2, 5, "before", "late", ahead=a) for a in (5, 10, 16)] \
    + [ProbeConfig("tp8-st5-ahead5-stash4", 34, 2, 5, "before", "late", stash=4, ahead=5)] \
    + [ProbeConfig(f"tp8-s1-st{st}-{trig}", 34, 1, st, "before", trig) for st, trig in
       ((11, "early"), (11, "late"), (5, "late"))] \
    + [ProbeConfig(f"tp4-st4-stash{t}", 68, 2, 4, "before", "exit", stash=t) for t in (0, 2, 4)] \
    + [ProbeConfig(f"tp4-st4-late-ahead{a}", 68, 2, 4, "before", "late", ahead=a) for a in (0, 4)] \
    + [ProbeConfig(f"tp2-st4-stash{t}", 136, 1, 4, "before", "late", stash=t) for t in (0, 4)]
# round 16b: the two levers that paid at TP8 (stash, ahead) on a finer grid, two token tiles, and TP4 laid out
# as TP8 is (S = 1: 68 CTAs, one per SM, the other SMs free for the next grid)
AHEAD_CONFIGS = [ProbeConfig(f"tp8-a{a}-s{t}", 34, 2, 5, "before", "late", stash=t, ahead=a)
                 for a, t in [(a, 0) for a in (0, 2, 3, 4, 5, 6, 7, 8)]
                 + [(a, t) for a in (3, 4, 5, 6) for t in (1, 2, 4)]] \
    + [ProbeConfig(f"tp8-tt16-a{a}-s{t}", 34, 2, 5, "before", "late", 16, stash=t, ahead=a)
       for a, t in ((0, 0), (5, 0), (5, 2), (5, 4))] \
    + [ProbeConfig(f"tp4-s1-st5-a{a}-s{t}", 68, 1, 5, "before", "late", stash=t, ahead=a)
       for a, t in ((0, 0), (5, 0), (5, 2), (5, 4), (8, 4))] \
    + [ProbeConfig("tp4-s1-st11-early", 68, 1, 11, "before", "early"),
       ProbeConfig("tp4-s2-st4-a2-s2", 68, 2, 4, "before", "late", stash=2, ahead=2)]
# issue 30: the e4m3 front's bytes (hidden 4096 bf16 = 8192 e4m3 a row) on TP8's grids, the planned e4m3 ring (10
# stages of 8 KiB = 5 of 16, the last 10 k-tiles ahead of the trigger = 5), k_split 4 (8 stages of 8 KiB: 4), beside
# the bf16 plan's skeleton (6 stages, trigger 6 ahead), all under the real dependency; TP1's planned e4m3 ring (20
# stages of 8 KiB: 10)
E4M3_CONFIGS = [ProbeConfig("tp8-bf16-plan", 34, 2, 6, "before", "late", ahead=6),
                ProbeConfig("tp8-e4m3-s2", 34, 2, 5, "before", "late", ahead=5, hidden=HIDDEN // 2),
                ProbeConfig("tp8-e4m3-s2-after", 34, 2, 5, "after", "late", ahead=5, hidden=HIDDEN // 2),
                ProbeConfig("tp8-e4m3-s4", 34, 4, 4, "before", "exit", 16, hidden=HIDDEN // 2),
                ProbeConfig("tp8-e4m3-s4-after", 34, 4, 4, "after", "exit", 16, hidden=HIDDEN // 2),
                ProbeConfig("tp1-e4m3", 272, 1, 10, "before", "early", hidden=HIDDEN // 2)]
CONFIG_SETS = {"planned": CONFIGS, "stash": STASH_CONFIGS, "ahead": AHEAD_CONFIGS, "e4m3": E4M3_CONFIGS}


# ---------------------------------------------------------------------------------------------- build (CPU)
def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int64
    from cutlass.cute.nvgpu import cpasync
    from cutlass.memory import SmemAllocator

    from musekern.kernels.qkv_front.ring import ring_tma

    class SkeletonProbe:
        def __init__(self, c: ProbeConfig):
            self.c = c
            self.ntiles = c.ntiles

            @cute.struct
            class Smem:
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, HEAD_COLS * K_TILE * c.stages], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[BFloat16, c.tt * K_TILE * c.stages], 1024]
                sXs: cute.struct.Align[cute.struct.MemRange[BFloat16, c.tt * K_TILE * max(c.stash, 1)], 1024]
                xs_full: cute.struct.MemRange[Int64, 1]
                full: cute.struct.MemRange[Int64, c.stages]
                empty: cute.struct.MemRange[Int64, c.stages]
            self.Smem = Smem

        @cute.jit
        def __call__(self, w_ptr: cute.Pointer, x_ptr: cute.Pointer, o_ptr: cute.Pointer, stream: cuda.CUstream):
            c = self.c
            mW = cute.make_tensor(w_ptr, cute.make_layout((c.heads * HEAD_COLS, c.hidden), stride=(c.hidden, 1)))
            mX = cute.make_tensor(x_ptr, cute.make_layout((c.tt, c.hidden), stride=(c.hidden, 1)))
            mO = cute.make_tensor(o_ptr, cute.make_layout(c.heads * c.k_split))
            sW_l, sX_l, tma_w, mW_t, tma_x, mX_t = ring_tma(mW, mX, c.stages, c.tt)  # the front's own ring
            sXs_l = ring_tma(mW, mX, max(c.stash, 1), c.tt)[1]  # the stashed tiles' x, same boxes
            self.kernel(tma_w, mW_t, tma_x, mX_t, mO, sW_l, sX_l, sXs_l).launch(
                grid=[c.heads * c.k_split, 1, 1], block=[THREADS, 1, 1], cluster=[c.k_split, 1, 1],
                smem=self.Smem.size_in_bytes(), stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, mW_t: cute.Tensor, tma_x: cute.CopyAtom, mX_t: cute.Tensor,
                   mO: cute.Tensor, sW_l: cute.ComposedLayout, sX_l: cute.ComposedLayout,
                   sXs_l: cute.ComposedLayout):
            c = self.c
            tidx = cute.arch.thread_idx()[0]
            bidx = cute.arch.block_idx()[0]
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            head = bidx // c.k_split
            rank = bidx % c.k_split
            st = SmemAllocator().allocate(self.Smem)
            sW = st.sW.get_tensor(sW_l.outer, swizzle=sW_l.inner)
            sX = st.sX.get_tensor(sX_l.outer, swizzle=sX_l.inner)
            sXs = st.sXs.get_tensor(sXs_l.outer, swizzle=sXs_l.inner)
            xs_full = st.xs_full.data_ptr()
            full = st.full.data_ptr()
            empty = st.empty.data_ptr()
            tx = W_STAGE + (c.tt * K_TILE * 2 if cutlass.const_expr(c.mode == "before") else 0)
            if tidx == 0:
                for s in cutlass.range_constexpr(c.stages):
                    cute.arch.mbarrier_init(full + s, 1)
                    cute.arch.mbarrier_init(empty + s, 4)
                cute.arch.mbarrier_init(xs_full, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if cutlass.const_expr(c.trigger == "early"):
                cute.arch.griddepcontrol_launch_dependents()
            rot = (head * 1) % self.ntiles  # k_rotate 1, as planned
            if warp_idx == 4:
                gW = cute.local_tile(mW_t, (HEAD_COLS, K_TILE), (head, None))
                gX = cute.local_tile(mX_t, (c.tt, K_TILE), (0, None))
                tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                                 cute.group_modes(gW, 0, 2))
                tXs, tXg = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                                 cute.group_modes(gX, 0, 2))
                tXss, _ = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sXs, 0, 2),
                                                cute.group_modes(gX, 0, 2))
                # W of the first `pre` k-tiles goes before the wait: the ring, plus the refills of the slots the
                # consumers free by stashing k-tiles 0..stash-1 (whose full barriers expect W only)
                pre = c.stages + c.stash
                for i in cutlass.range_constexpr(pre):
                    sp = i % c.stages
                    if cutlass.const_expr(i >= c.stages):
                        cute.arch.mbarrier_wait(empty + sp, ((i // c.stages) - 1) % 2)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + sp, W_STAGE if i < c.stash else tx)
                    cute.copy(tma_w, tWg[None, rank + ((i + rot) % self.ntiles) * c.k_split], tWs[None, sp],
                              tma_bar_ptr=full + sp)
                if cutlass.const_expr(c.mode == "before"):
                    cute.arch.griddepcontrol_wait()
                    if cutlass.const_expr(c.stash > 0):
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(xs_full, c.stash * c.tt * K_TILE * 2)
                        for i in cutlass.range_constexpr(c.stash):
                            cute.copy(tma_x, tXg[None, rank + ((i + rot) % self.ntiles) * c.k_split],
                                      tXss[None, i], tma_bar_ptr=xs_full)
                    for i in cutlass.range_constexpr(c.stash, pre):
                        cute.copy(tma_x, tXg[None, rank + ((i + rot) % self.ntiles) * c.k_split],
                                  tXs[None, i % c.stages], tma_bar_ptr=full + i % c.stages)
                for i in cutlass.range(pre, self.ntiles, unroll=1):
                    s = i % c.stages
                    cute.arch.mbarrier_wait(empty + s, ((i // c.stages) - 1) % 2)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + s, tx)
                    k = rank + ((i + rot) % self.ntiles) * c.k_split
                    cute.copy(tma_w, tWg[None, k], tWs[None, s], tma_bar_ptr=full + s)
                    if cutlass.const_expr(c.mode == "before"):
                        cute.copy(tma_x, tXg[None, k], tXs[None, s], tma_bar_ptr=full + s)
                    if cutlass.const_expr(c.trigger == "late" and c.ahead > 0):
                        if i == self.ntiles - 1 - c.ahead:
                            cute.arch.griddepcontrol_launch_dependents()
                if cutlass.const_expr(c.trigger == "late" and c.ahead == 0):
                    cute.arch.griddepcontrol_launch_dependents()
            else:
                acc = Float32(0.0)
                for i in cutlass.range_constexpr(c.stash):  # taken before x exists, as a register stash would
                    ss = i % c.stages
                    cute.arch.mbarrier_wait(full + ss, (i // c.stages) % 2)
                    acc = acc + Float32(sW[tidx % HEAD_COLS, (tidx * 8) % K_TILE, ss])
                    cute.arch.sync_warp()
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive(empty + ss)
                if cutlass.const_expr(c.mode == "before"):
                    cute.arch.griddepcontrol_wait()  # the front's MMA needs x from the first k-tile
                    if cutlass.const_expr(c.stash > 0):
                        cute.arch.mbarrier_wait(xs_full, 0)
                        acc = acc + Float32(sXs[tidx % c.tt, (tidx * 8) % K_TILE, tidx % c.stash])
                for i in cutlass.range(c.stash, self.ntiles, unroll=1):
                    s = i % c.stages
                    cute.arch.mbarrier_wait(full + s, (i // c.stages) % 2)
                    acc = acc + Float32(sW[tidx % HEAD_COLS, (tidx * 8) % K_TILE, s])
                    if cutlass.const_expr(c.mode == "before"):
                        acc = acc + Float32(sX[tidx % c.tt, (tidx * 8) % K_TILE, s])
                    cute.arch.sync_warp()
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive(empty + s)
                if cutlass.const_expr(c.mode == "after"):
                    cute.arch.griddepcontrol_wait()  # before the store only: the anchor probe's dependency
                if tidx == 0:
                    mO[bidx] = acc
    return SkeletonProbe


def build(outdir: str, config_set: str = "planned") -> None:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from cutlass.cute.runtime import make_ptr

    from musekern.builder.dsl import compile_to_cubin
    from musekern.store.abi import KernelAbi, LaunchSpec, TensorMapSpec, check_abi_against_ptx, pointer, tensormap

    os.makedirs(outdir, exist_ok=True)
    cls = _kernel_class()
    bf = make_ptr(BFloat16, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)
    f32 = make_ptr(Float32, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)
    manifest = []
    from musekern.kernels.qkv_front.variant import ring_smem_bytes

    for c in CONFIG_SETS[config_set]:
        k = cls(c)
        # launched with the planned front's dynamic shared memory, so CTAs share SMs exactly as the front's do
        smem = max(k.Smem.size_in_bytes(), ring_smem_bytes(c.stages, c.tt // 8, c.k_split))
        cubin, ptx, symbol = compile_to_cubin(k, bf, bf, f32, cuda.CUstream(0), arch="sm_90a")
        abi = KernelAbi(params=(tensormap("tma_w"), tensormap("tma_x"), pointer("out")),
                        launch=LaunchSpec(block=(THREADS, 1, 1), cluster=(c.k_split, 1, 1),
                                          dynamic_smem_bytes=smem, pdl=True,
                                          grid=f"({c.heads * c.k_split}, 1, 1)"),
                        tensormaps=(TensorMapSpec("tma_w", "weight", "bf16", (64, HEAD_COLS)),
                                    TensorMapSpec("tma_x", "x", "bf16", (64, c.tt))))
        check_abi_against_ptx(abi, ptx, symbol)
        open(os.path.join(outdir, f"{c.name}.cubin"), "wb").write(cubin)
        manifest.append({"config": asdict(c), "symbol": symbol, "abi": abi.to_json()})
        print(f"built {c.name}: {smem} B smem", file=sys.stderr)
    json.dump(manifest, open(os.path.join(outdir, "manifest.json"), "w"), indent=1)
    from bench.harness.report import git_state

    json.dump({**git_state(), "set": config_set}, open(os.path.join(outdir, "BUILD_INFO.json"), "w"))


# ---------------------------------------------------------------------------------------------- run (GPU)
class _Entry:
    def __init__(self, m):
        self.key = m["config"]["name"]
        self.manifest = {"label": self.key, "symbol": m["symbol"], "abi": m["abi"]}


def run(outdir: str, out_json: str, only: str = "") -> int:
    import torch

    from bench.harness.timing import Graph, copy_bandwidth, loops_for, time_graphs
    from musekern.runtime.loader import LoadedKernel

    bw = copy_bandwidth()
    man = json.load(open(os.path.join(outdir, "manifest.json")))
    xs = {(tt, h): torch.randn(tt, h, device="cuda").to(torch.bfloat16)
          for tt in (8, 16) for h in (HIDDEN, HIDDEN // 2)}
    rows, weights = [], {}
    for m in man:
        c = ProbeConfig(**m["config"])
        if not c.name.startswith(only):
            continue
        if (c.heads, c.hidden) not in weights:
            weights.clear()
            weights[c.heads, c.hidden] = [(torch.randn(c.heads * HEAD_COLS, c.hidden, device="cuda") / 90).to(
                torch.bfloat16) for _ in range(LAYERS)]
        k = LoadedKernel(_Entry(m), open(os.path.join(outdir, f"{c.name}.cubin"), "rb").read(),
                         torch.cuda.current_device())
        out = torch.empty(c.heads * c.k_split, device="cuda")
        grid = (c.heads * c.k_split, 1, 1)
        args = [{"weight": w, "x": xs[c.tt, c.hidden], "out": out.data_ptr()} for w in weights[c.heads, c.hidden]]
        graphs = [Graph(mode, [lambda a=a, p=pdl, k=k, g=grid: k.launch(g, a, pdl=p) for a in args],
                        loops_for(LAYERS * 15e-6), LAYERS) for mode, pdl in (("chain", True), ("isolated", False))]
        t = time_graphs(graphs, samples=7)
        wbytes = c.heads * HEAD_COLS * c.hidden * 2
        row = {**asdict(c), "floor_us": round(wbytes / (bw * 1e12) * 1e6, 3)}
        for g in ("chain", "isolated"):
            row[f"{g}_us"] = round(t[g]["us"], 3)
            row[f"{g}_frac"] = round(wbytes / (t[g]["us"] * 1e-6) / (bw * 1e12), 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    info = json.load(open(os.path.join(outdir, "BUILD_INFO.json"))) if os.path.exists(
        os.path.join(outdir, "BUILD_INFO.json")) else {}
    json.dump({"commit": info.get("commit"), "dirty": info.get("dirty"), "set": info.get("set"),
               "device": torch.cuda.get_device_name(), "copy_TBps": round(bw, 3),
               "command": "python3 bench/probes/skeleton_probe.py run " + " ".join(sys.argv[2:]), "rows": rows},
              open(out_json, "w"), indent=1)
    print(f"{'config':22} {'floor':>6} {'chain us':>9} {'frac':>6} {'isol us':>8} {'frac':>6}")
    for r in rows:
        print(f"{r['name']:22} {r['floor_us']:6.2f} {r['chain_us']:9.2f} {r['chain_frac']:6.3f} "
              f"{r['isolated_us']:8.2f} {r['isolated_frac']:6.3f}")
    return 0


def main(argv) -> int:
    if len(argv) >= 2 and argv[0] == "build" and (len(argv) == 2 or argv[2] in CONFIG_SETS):
        build(argv[1], *argv[2:3])
        return 0
    if len(argv) >= 3 and argv[0] == "run":
        return run(argv[1], argv[2], argv[3] if len(argv) > 3 else "")
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
