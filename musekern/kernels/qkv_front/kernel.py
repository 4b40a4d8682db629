"""qkv_front: the fused Muse Spark decode attention front (seed 000), in CuTe DSL for sm_90a.

y = epilogue(bf16(x @ W^T)); see musekern/reference.py::qkv_front_reference for the exact math.

Launch (musekern/kernels/qkv_front/variant.py is the single source of truth for every constant):
  (S = k_split, the variant's CTAs per head splitting K)
  grid  = heads * S CTAs along x, S consecutive CTAs per head (64 columns of y); cluster = (S, 1, 1), or
  (2 S, 1, 1) with x_mcast (a head pair), block = 192 threads: warps 0-3 consumers (mma.sync or wgmma),
  warp 4 TMA producer, warp 5 aux.
CTA rank r of a head streams the k-tiles r, r+S, r+2S, ... (K_TILE = 128 columns each, 64/S tiles: S
divides 64; head h starts h tiles further on, cyclically; with x_mcast both heads of a pair start at
the pair's first) of its head's 64 W rows and of x through a `stages`-deep shared-memory ring (with
`recv_in_ring` the owner's receive buffer reuses it once the whole cluster is past its last k-tile):
  - W: two 64x64 bf16 TMA boxes per stage (128B swizzle) = 16 KiB;
  - x: two 64 x TT boxes per stage (TT = 8*tiles tokens), loaded by TMA too, from a tensor map
    whose row count is M: rows M..TT-1 are outside the tensor, so TMA zero-fills them (never an
    out-of-bounds read) and still counts the full box bytes on the mbarrier. With x_mcast each CTA of
    a head pair loads half of the rows (64 x TT/2 boxes) and multicasts them into both rings; a stage's
    empty barrier then counts both heads' consumer warps (each warp arrives locally and on the peer).
The consumers (mma.py; FP32 accumulate): warp_split "rows", warp w computes W rows [16w, 16w+16) x TT tokens with
mma.sync m16n8k16 from ldmatrix loads of the swizzled ring; "k", warp w all 64 rows over k columns [32w, 32w+32) of
every k-tile, the four warps' partials summed in warp order in the idle W ring after the last k-tile; "wg" (3 token
tiles and more), warpgroup 0 issues wgmma m64nTTk16 with both operands straight from the ring. After the last k-tile
each consumer thread sends its FP32 partial of token t to the owner CTA of its head, rank t % S, with st.async (DSMEM,
completes on the owner's receive mbarrier); the owner sums the S partials in rank order 0..S-1 (bitwise
deterministic: the order depends on neither the ring depth nor timing), rounds to bf16 and runs the epilogue for its
tokens:
RMS norm (q, k heads), interleaved RoPE (q, k), y store, K/V cache insert (k, v heads): a lane per RoPE pair, or in the
wgmma builds with 16 owned tokens or more eight lanes a token with 16-byte accesses (kernels/qkv_front/octets.py).
With S == 1 the partials go to the CTA's own shared memory with plain stores; so do, in the wgmma builds with S > 1,
the partials of the CTA's own tokens (st.async carries the other S - 1 ranks'; bench/NOTES.md "The partials'
exchange").

PDL: before griddepcontrol.wait the kernel reads only W (the producer prefills the ring with W
tiles); every thread executes griddepcontrol.wait before it reads x, positions, slots or
cos|sin and before any global store; griddepcontrol.launch_dependents right after init
(variant trigger "early"), once the producer has issued its last load ("late"; with trigger_ahead > 0, its
load that many k-tiles before the last), or never ("exit": a CTA counts as triggered when it exits).

FP8 builds (variant kv_cache_dtype "fp8_e4m3", entry `kernel_fp8`: four more parameters, the scales) store the k / v
cache rows as e4m3(value / scale) bytes, half the bf16 stores' width (fp8.py); the owner's consumer threads of a k or
v head read their scale once, after griddepcontrol.wait. y and everything else are the bf16 build's.

e4m3-weight builds (variant weight_dtype "fp8_e4m3", w8.py): the ring streams e4m3 W (8 KiB a stage), the consumers
dequantize it into the bf16 MMA's A registers ("k", W8A16) or the ring holds W only and all of the CTA's x lands up
front, a barrier a chunk, quantized to e4m3 in place by the consumers (chunk 0) and the aux warp (the rest) for wgmma
e4m3 ("wg", W8A8); the fp32 multipliers (the `weight_scale` launch value, in the bf16 builds' unread weight_ptr slot)
scale the partials (per row) or each k-tile's sum (per 64 x 128 block).

Out-of-range positions (p < 0 or p >= max_pos) are clamped to [0, max_pos - 1] for the cos|sin
read (the reference does the same). Slots < 0 or >= num_blocks * block_size write nothing.
"""
# (no `from __future__ import annotations`: @cute.struct and @cute.jit read real annotation objects)

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator
from cutlass.utils import hopper_helpers as sm90_utils

from ...store.keys import variant_tag
from . import fp8 as _fp8
from .mma import BAR_AUX, BAR_PARTIALS, BAR_RED, CONSUMER_THREADS, CtaPlace, FrontConsumers
from .octets import OCTET_MIN_OWNED, FrontOctetEpilogue
from .ring import make_smem_struct, ring_tma
from .variant import (
    CONSUMER_WARPS,
    HEAD_COLS,
    HIDDEN,
    K_TILE,
    K_TILES,
    MAX_OWNED_TOKENS,
    THREADS,
    TOKEN_TILE,
    X8_CHUNK,
    QkvFrontVariant,
    launch_grid,
    owned_tokens,
    padded_tokens,
    smem_bytes,
    w_stage_bytes,
    x_bytes,
)

PRODUCER_WARP = CONSUMER_WARPS  # warp 4
AUX_WARP = CONSUMER_WARPS + 1  # warp 5


class QkvFrontKernel(FrontConsumers, FrontOctetEpilogue):
    """One compiled qkv_front variant. Static: N, KV heads, tiles, ring depth, S, fixed M."""

    def __repr__(self):
        # CuTe DSL names the compiled kernel after str(self) (the jit's `self` argument, its address dropped): the
        # variant's tag in it makes the entry symbol this variant's alone (store/variant_abi.py refuses a sibling's
        # build under the key by it); the class's old module path keeps the rest of the name as it was.
        return f"<musekern.kernels.qkv_front.QkvFrontKernel {variant_tag(self.v.kernel, self.v.params())} object at " \
               f"{id(self):#x}>"

    def __init__(self, v: QkvFrontVariant):
        assert HIDDEN % K_TILE == 0 and K_TILES % v.k_split == 0, "S must divide the 64 k-tiles"
        assert v.fixed_rows in (0, TOKEN_TILE) and (v.fixed_rows == 0 or v.tiles == 1)
        self.v = v
        self.n = v.n
        self.heads = v.heads
        self.nkv = v.num_kv_heads
        self.nq = v.num_q_heads
        self.stages = v.stages
        self.k_split = v.k_split
        self.pair = 2 if v.x_mcast else 1  # heads of a cluster: x multicast between the two of a pair
        self.cluster = self.k_split * self.pair
        self.tt = padded_tokens(v)  # tokens the MMA computes
        self.owned = owned_tokens(v.tiles, v.k_split)  # tokens per owner CTA (S divides TT)
        # every consumer warp owns the same number of tokens in the epilogue
        assert self.tt % self.k_split == 0 and self.owned % CONSUMER_WARPS == 0 and self.owned <= MAX_OWNED_TOKENS
        self.ntiles = K_TILES // self.k_split  # k-tiles per CTA
        assert self.stages <= self.ntiles
        self.w8 = v.weight_dtype != "bf16"  # e4m3 weights (w8.py)
        self.block_scales = v.weight_scale == "block"
        self.stage_tx = w_stage_bytes(v.weight_dtype) + self.tt * K_TILE * 2  # bytes landing per stage
        # the wgmma builds store their own tokens' partials with plain stores: st.async carries only the other S - 1
        # ranks' (bench/NOTES.md "The partials' exchange")
        self.local_partials = v.warp_split == "wg" and self.k_split > 1
        # bytes an owner gets by st.async
        self.recv_tx = (self.k_split - self.local_partials) * self.owned * HEAD_COLS * 4
        self.x8 = self.w8 and v.warp_split == "wg"  # W8A8: all of the CTA's x up front, quantized in place (w8.py)
        self.x8_ahead = v.x_dtype == "fp8_e4m3"  # ... or x_quant's e4m3 x and scales, read as they are
        self.x_slots = self.ntiles if self.x8 else 0  # x's ring slots (0: one a stage)
        if self.x8:
            self.stage_tx = w_stage_bytes(v.weight_dtype)  # a stage is W only
        self.Smem = make_smem_struct(self.stages, self.tt, self.owned, v.recv_in_ring,
                                     Float8E4M3FN if self.w8 else BFloat16, self.block_scales,
                                     self.x_slots, Float8E4M3FN if self.x8_ahead else BFloat16)
        assert not v.recv_in_ring or self.tt * HEAD_COLS * 4 <= self.stages * w_stage_bytes(v.weight_dtype)
        self.smem = smem_bytes(v)
        self.fp8 = v.kv_cache_dtype != "bf16"  # e4m3 caches: `kernel_fp8`

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, w_ptr: cute.Pointer, x_ptr: cute.Pointer, y_ptr: cute.Pointer, pos_ptr: cute.Pointer,
                 cs_ptr: cute.Pointer, slot_ptr: cute.Pointer, kc_ptr: cute.Pointer, vc_ptr: cute.Pointer,
                 M: Int32, max_pos: Int32, block_size: Int32, num_blocks: Int32, k_block_stride: Int64,
                 v_block_stride: Int64, eps: Float32, stream: cuda.CUstream, *tail):
        # tail: e4m3 weights: the weight_scale pointer (in the kernel's w_ptr slot), x quantized ahead: x_scale;
        # FP8 caches: the four scales
        mW = cute.make_tensor(w_ptr, cute.make_layout((self.n, HIDDEN), stride=(HIDDEN, 1)))
        scales = tail[(1 + self.x8_ahead):] if cutlass.const_expr(self.w8) else tail
        w_slot = tail[0] if cutlass.const_expr(self.w8) else w_ptr
        if cutlass.const_expr(self.v.fixed_rows):
            mX = cute.make_tensor(x_ptr, cute.make_layout((self.v.fixed_rows, HIDDEN), stride=(HIDDEN, 1)))
        else:
            mX = cute.make_tensor(x_ptr, cute.make_layout((M, HIDDEN), stride=(HIDDEN, 1)))
        sW_layout, sX_layout, tma_w, mW_tma, tma_x, mX_tma = ring_tma(mW, mX, self.stages, self.tt, self.v.x_mcast,
                                                                      self.x_slots)
        mma_op = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        if cutlass.const_expr(self.v.warp_split == "rows"):
            # 4 warps along M (16 W rows each); every warp covers all TT tokens (tiles n8 atoms)
            tiled_mma = cute.make_tiled_mma(mma_op, (CONSUMER_WARPS, 1, 1),
                                            permutation_mnk=(16 * CONSUMER_WARPS, self.tt, 16))
        else:
            # one warp's MMA: sliced by lane; the 64 rows are 4 m16 repeats, the TT tokens 1 or 2 n8 atoms
            tiled_mma = cute.make_tiled_mma(mma_op, (1, 1, 1), permutation_mnk=(16, self.tt, 16))
        assert self.Smem.size_in_bytes() == self.smem, (self.Smem.size_in_bytes(), self.smem)
        args = (tma_w, mW_tma, tma_x, mX_tma, w_slot, y_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, max_pos,
                block_size, num_blocks, k_block_stride, v_block_stride, eps, tiled_mma, sW_layout, sX_layout)
        if cutlass.const_expr(self.x8_ahead):  # x_scale after weight_scale (the w_ptr slot)
            xargs = args[:5] + (tail[1],) + args[5:]
            entry = self.kernel_xa_fp8(*xargs, *scales) if cutlass.const_expr(self.fp8) else self.kernel_xa(*xargs)
            entry.launch(grid=list(launch_grid(self.v)), block=[THREADS, 1, 1], cluster=[self.cluster, 1, 1],
                         smem=self.smem, stream=stream, use_pdl=True)
        elif cutlass.const_expr(self.fp8):  # the scales (kv_cache.SCALE_PARAMS) after the bf16 build's parameters
            self.kernel_fp8(*args, *scales).launch(grid=list(launch_grid(self.v)), block=[THREADS, 1, 1],
                                                   cluster=[self.cluster, 1, 1], smem=self.smem, stream=stream,
                                                   use_pdl=True)
        else:
            self.kernel(*args).launch(grid=list(launch_grid(self.v)), block=[THREADS, 1, 1],
                                      cluster=[self.cluster, 1, 1], smem=self.smem, stream=stream, use_pdl=True)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, mW_tma: cute.Tensor, tma_x: cute.CopyAtom, mX_tma: cute.Tensor,
               w_ptr: cute.Pointer, y_ptr: cute.Pointer, pos_ptr: cute.Pointer, cs_ptr: cute.Pointer,
               slot_ptr: cute.Pointer, kc_ptr: cute.Pointer, vc_ptr: cute.Pointer, max_pos: Int32,
               block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64, eps: Float32,
               tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout):
        """The bf16 builds' entry."""
        self.body(tma_w, mW_tma, tma_x, mX_tma, w_ptr, y_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, max_pos,
                  block_size, num_blocks, k_block_stride, v_block_stride, eps, tiled_mma, sW_layout, sX_layout, None)

    @cute.kernel
    def kernel_fp8(self, tma_w: cute.CopyAtom, mW_tma: cute.Tensor, tma_x: cute.CopyAtom, mX_tma: cute.Tensor,
                   w_ptr: cute.Pointer, y_ptr: cute.Pointer, pos_ptr: cute.Pointer, cs_ptr: cute.Pointer,
                   slot_ptr: cute.Pointer, kc_ptr: cute.Pointer, vc_ptr: cute.Pointer, max_pos: Int32,
                   block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64, eps: Float32,
                   tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout,
                   k_scale_ptr: cute.Pointer, k_scale: Float32, v_scale_ptr: cute.Pointer, v_scale: Float32):
        """The FP8 builds' entry: the bf16 one's parameters, then the scales'."""
        self.body(tma_w, mW_tma, tma_x, mX_tma, w_ptr, y_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, max_pos,
                  block_size, num_blocks, k_block_stride, v_block_stride, eps, tiled_mma, sW_layout, sX_layout,
                  (k_scale_ptr, k_scale, v_scale_ptr, v_scale))

    @cute.kernel
    def kernel_xa(self, tma_w: cute.CopyAtom, mW_tma: cute.Tensor, tma_x: cute.CopyAtom, mX_tma: cute.Tensor,
                  w_ptr: cute.Pointer, xs_ptr: cute.Pointer, y_ptr: cute.Pointer, pos_ptr: cute.Pointer,
                  cs_ptr: cute.Pointer, slot_ptr: cute.Pointer, kc_ptr: cute.Pointer, vc_ptr: cute.Pointer,
                  max_pos: Int32, block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64,
                  eps: Float32, tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout,
                  sX_layout: cute.ComposedLayout):
        """The entry of the builds reading x quantized ahead (x_dtype fp8_e4m3): x_scale after weight_scale."""
        self.body(tma_w, mW_tma, tma_x, mX_tma, w_ptr, y_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, max_pos,
                  block_size, num_blocks, k_block_stride, v_block_stride, eps, tiled_mma, sW_layout, sX_layout, None,
                  xs_ptr)

    @cute.kernel
    def kernel_xa_fp8(self, tma_w: cute.CopyAtom, mW_tma: cute.Tensor, tma_x: cute.CopyAtom, mX_tma: cute.Tensor,
                      w_ptr: cute.Pointer, xs_ptr: cute.Pointer, y_ptr: cute.Pointer, pos_ptr: cute.Pointer,
                      cs_ptr: cute.Pointer, slot_ptr: cute.Pointer, kc_ptr: cute.Pointer, vc_ptr: cute.Pointer,
                      max_pos: Int32, block_size: Int32, num_blocks: Int32, k_block_stride: Int64,
                      v_block_stride: Int64, eps: Float32, tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout,
                      sX_layout: cute.ComposedLayout, k_scale_ptr: cute.Pointer, k_scale: Float32,
                      v_scale_ptr: cute.Pointer, v_scale: Float32):
        """kernel_xa with an FP8 cache: the caches' scales last."""
        self.body(tma_w, mW_tma, tma_x, mX_tma, w_ptr, y_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, max_pos,
                  block_size, num_blocks, k_block_stride, v_block_stride, eps, tiled_mma, sW_layout, sX_layout,
                  (k_scale_ptr, k_scale, v_scale_ptr, v_scale), xs_ptr)

    @cute.jit
    def body(self, tma_w, mW_tma, tma_x, mX_tma, w_ptr, y_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, max_pos,
             block_size, num_blocks, k_block_stride, v_block_stride, eps, tiled_mma, sW_layout, sX_layout, scales,
             xs_ptr=None):
        tidx = cute.arch.thread_idx()[0]
        bidx = cute.arch.block_idx()[0]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        head = bidx // self.k_split
        # clusters are S * pair consecutive CTAs: k-split rank r of pair member m is cluster rank r + S m
        rank = Int32(0)
        member = Int32(0)
        if cutlass.const_expr(self.cluster > 1):
            crank = cute.arch.block_idx_in_cluster()
            rank = crank % self.k_split
            member = crank // self.k_split
        place = CtaPlace(head, rank, member, rank + self.k_split * (1 - member))
        M = cute.size(mX_tma, mode=[0])  # runtime M (or the static 8 of the M == 8 build)

        st = SmemAllocator().allocate(self.Smem)
        sW = st.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)  # (64, 128, stages), swizzled
        sX = st.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)  # (TT, 128, stages), swizzled
        full = st.full.data_ptr()
        empty = st.empty.data_ptr()
        recv_bar = st.recv_bar.data_ptr()

        if warp_idx == PRODUCER_WARP:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, CONSUMER_WARPS * self.pair)  # x_mcast: both heads release
            cute.arch.mbarrier_init(recv_bar, 1)
            if cutlass.const_expr(self.x8):
                for c in cutlass.range_constexpr(self.ntiles // X8_CHUNK):
                    cute.arch.mbarrier_init(st.xfull.data_ptr() + c, 1)
                    cute.arch.mbarrier_init(st.cfull.data_ptr() + c, 32)  # the aux warp's lanes
            cute.arch.mbarrier_init_fence()
            if cutlass.const_expr(self.k_split > 1):
                # arm the receive barrier before the cluster sync, i.e. before any peer can send
                cute.arch.mbarrier_arrive_and_expect_tx(recv_bar, self.recv_tx)
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()  # every CTA's barriers are initialised and armed
        else:
            cute.arch.sync_threads()
        if cutlass.const_expr(self.v.trigger == "early"):
            cute.arch.griddepcontrol_launch_dependents()  # PDL: the next grid may start its W prefetch

        if warp_idx == PRODUCER_WARP:
            self.producer(tma_w, mW_tma, tma_x, mX_tma, sW, sX, full, empty, place,
                          *((st.xfull.data_ptr(),) if self.x8 else ()))
            self.ring_idle()
        elif warp_idx == AUX_WARP:
            self.aux(st, pos_ptr, cs_ptr, slot_ptr, M, max_pos, place)
            if cutlass.const_expr(self.x8_ahead):
                self.stage_x_scales(st, xs_ptr, M, place)
            elif cutlass.const_expr(self.x8):
                self.quantizer(st, M)
            self.ring_idle()
        else:
            if cutlass.const_expr(self.v.warp_split == "wg"):
                # the 4 consumer warps = warpgroup 0: wgmma m64nTTk16, A (W) and B (x) K-major from the swizzled
                # ring (made here, not passed in: its ACCUMULATE field would become a kernel parameter)
                # (e4m3 weights: W8A8, wgmma m64nTTk32 e4m3 (QGMMA) on the e4m3 ring and x quantized per k-tile, w8.py)
                ab = Float8E4M3FN if self.w8 else BFloat16
                wg_mma = sm90_utils.make_trivial_tiled_mma(ab, ab, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                           (1, 1, 1), (HEAD_COLS, self.tt))
                wq = self.w8_state(st, w_ptr, wg_mma, tidx, place)
                if cutlass.const_expr(self.w8):
                    x8_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float8E4M3FN)
                    # k-tile i's quantized x: the first tt x 128 bytes of its bf16 slot (layout index 2 i), or the
                    # slot itself (x quantized ahead: index i)
                    x8_layout = cute.tile_to_shape(x8_atom, (self.tt, K_TILE, (2 - self.x8_ahead) * self.ntiles),
                                                   order=(0, 1, 2))
                    sX8 = st.sX.get_tensor(x8_layout.outer, swizzle=x8_layout.inner, dtype=Float8E4M3FN)
                    acc = self.consumer_wg8(wg_mma, st, sW, sX8, full, empty, tidx, place, wq, M)
                else:
                    acc = self.consumer_wg(wg_mma, sW, sX, full, empty, tidx, place)
                self.ring_idle()
                self.send(wg_mma, acc, st, recv_bar, tidx, place, wq)
            elif cutlass.const_expr(self.v.warp_split == "rows"):
                wq = self.w8_state(st, w_ptr, tiled_mma, tidx, place)
                acc = self.consumer(tiled_mma, sW, sX, full, empty, tidx, place, wq)
                self.send(tiled_mma, acc, st, recv_bar, tidx, place, wq)
            else:
                wq = self.w8_state(st, w_ptr, tiled_mma, tidx, place)
                acc = self.consumer_k(tiled_mma, sW, sX, full, empty, warp_idx, tidx % 32, place, wq)
                self.reduce_send(tiled_mma, acc, st, recv_bar, warp_idx, tidx, place, wq)
            self.finish(st, recv_bar, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
                        v_block_stride, eps, place, warp_idx, tidx, scales)
        if cutlass.const_expr(self.cluster > 1):
            # nobody leaves while a peer may still write into its shared memory or arrive on its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def recv(self, st):
        """The owner's receive buffer, [src][j][col] fp32: its own array, or the W ring's start (`recv_in_ring`)."""
        if cutlass.const_expr(self.v.recv_in_ring):
            return cute.make_tensor(cute.recast_ptr(st.sW.data_ptr(), dtype=Float32),
                                    cute.make_layout(self.tt * HEAD_COLS))
        return st.recv.get_tensor(cute.make_layout(self.tt * HEAD_COLS))

    @cute.jit
    def ring_idle(self):
        """`recv_in_ring`: every thread of the cluster passes here once its role is done with the ring (consumers
        after their last MMA, producer after its last load, aux after staging): past it every ring of the cluster
        is idle and the partials may land in it. Without a cluster only this CTA's consumer warps take part. (A
        remote arrive on the other owners' barriers instead, once a CTA's consumers are past their last k-tile,
        measured slower at S = 4: bench/NOTES.md "The partials' exchange".)"""
        if cutlass.const_expr(self.v.recv_in_ring):
            if cutlass.const_expr(self.cluster > 1):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            elif cute.arch.make_warp_uniform(cute.arch.warp_idx()) < CONSUMER_WARPS:
                cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=CONSUMER_THREADS)

    @cute.jit
    def producer(self, tma_w, mW_tma, tma_x, mX_tma, sW, sX, full, empty, place, xfull=None):
        head, rank = place.head, place.rank
        gW = cute.local_tile(mW_tma, (HEAD_COLS, K_TILE), (head, None))  # (64, 128, 64 k-tiles)
        gX = cute.local_tile(mX_tma, (self.tt, K_TILE), (0, None))  # (TT, 128, 64 k-tiles)
        tWsW, tWgW = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                           cute.group_modes(gW, 0, 2))
        # x_mcast: member m loads rows [m TT/2, (m+1) TT/2) of each x tile into both heads' rings
        tXsX, tXgX = cpasync.tma_partition(tma_x, place.member, cute.make_layout(self.pair), cute.group_modes(sX, 0, 2),
                                           cute.group_modes(gX, 0, 2))
        # The i-th k-tile this CTA streams: head h starts h tiles further on (cyclically; both heads of an x_mcast
        # pair from the pair's first), so the clusters do not all read the same x tile from the same L2 lines at
        # the same moment (bench/NOTES.md "k_split"); the order is fixed per head, so results stay bitwise
        # reproducible.
        rot = (head - head % self.pair) % self.ntiles
        # Prefill: W only: weights are never written by the previous grid, so they may stream before
        # griddepcontrol.wait. The fresh ring takes k-tiles 0..stages-1 with no empty wait.
        for i in cutlass.range_constexpr(self.stages):
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + i, self.stage_tx)  # W + x bytes
            cute.copy(tma_w, tWgW[None, self._k_tile(i, rank, rot)], tWsW[None, i], tma_bar_ptr=full + i)
        cute.arch.griddepcontrol_wait()  # x may be the previous kernel's output
        if cutlass.const_expr(self.x8):  # all of the CTA's x k-tiles at once, a barrier a chunk (W8A8)
            for c in cutlass.range_constexpr(self.ntiles // X8_CHUNK):
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(xfull + c, X8_CHUNK * self.tt * K_TILE *
                                                            x_bytes(self.v.x_dtype))
                for i in cutlass.range_constexpr(c * X8_CHUNK, (c + 1) * X8_CHUNK):
                    self._load_x(tma_x, tXgX[None, self._k_tile(i, rank, rot)], tXsX[None, i], xfull + c, rank)
        else:
            for i in cutlass.range_constexpr(self.stages):
                self._load_x(tma_x, tXgX[None, self._k_tile(i, rank, rot)], tXsX[None, i], full + i, rank)
        for i in cutlass.range(self.stages, self.ntiles, unroll=1):
            s = i % self.stages
            # use u = i // stages of stage s: wait until the consumers released use u - 1
            cute.arch.mbarrier_wait(empty + s, ((i // self.stages) - 1) % 2)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + s, self.stage_tx)
            k = self._k_tile(i, rank, rot)
            cute.copy(tma_w, tWgW[None, k], tWsW[None, s], tma_bar_ptr=full + s)
            if cutlass.const_expr(not self.x8):
                self._load_x(tma_x, tXgX[None, k], tXsX[None, s], full + s, rank)
            if cutlass.const_expr(self.v.trigger == "late" and self.v.trigger_ahead > 0):
                if i == self.ntiles - 1 - self.v.trigger_ahead:
                    # one ring turn before the last load: the next grid's launch and prefill then overlap
                    # this grid's last loads instead of following them (bench/NOTES.md "pdl_trigger and
                    # trigger_ahead")
                    cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.v.trigger == "late" and self.v.trigger_ahead == 0):
            # every load of this CTA is issued: the next grid may land while the ring drains
            # (one thread's trigger counts for the whole CTA, PTX ISA griddepcontrol)
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _load_x(self, tma_x, src, dst, bar, rank):
        """One stage's x (x_mcast: this member's half, into both heads' rings; each ring's full barrier counts
        the whole tile)."""
        if cutlass.const_expr(self.v.x_mcast):
            mask = (1 << rank) | (1 << (rank + self.k_split))
            cute.copy(tma_x, src, dst, tma_bar_ptr=bar, mcast_mask=cutlass.Int16(mask))
        else:
            cute.copy(tma_x, src, dst, tma_bar_ptr=bar)

    def _k_tile(self, i, rank, rot):
        """The i-th k-tile a CTA of rank `rank` streams (traced inline: plain Python on DSL values)."""
        return rank + ((i + rot) % self.ntiles) * self.k_split

    @cute.jit
    def finish(self, st, recv_bar, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
               v_block_stride, eps, place, warp_idx, tidx, scales):
        """Owner epilogue: wait for the partials and the staged slots and cos|sin rows, then RMS norm, RoPE and the
        stores (the wgmma builds with 16 owned tokens or more: `finish_octets`; the others: `_finish_pairs`)."""
        head = place.head
        lane = tidx % 32
        recv = self.recv(st)
        cs = st.cs.get_tensor(cute.make_layout(self.owned * 64))
        slots = st.slots.get_tensor(cute.make_layout(self.owned))
        is_qk = head < self.nq + self.nkv
        is_k = head >= self.nq and head < self.nq + self.nkv
        is_v = head >= self.nq + self.nkv and head < self.nq + 2 * self.nkv
        kv_head = head - self.nq
        if is_v:
            kv_head = head - self.nq - self.nkv
        # before any global read or store here. It returns at once (the producer's wait came before x, which every
        # consumer has used), so it goes before the partials' waits: an FP8 build's scale load (the k or v head's
        # one) then lands while they last, not after them
        cute.arch.griddepcontrol_wait()
        kv_scale = None
        if cutlass.const_expr(self.fp8):
            kv_scale = Float32(1.0)
            if is_k:
                kv_scale = _fp8.kv_scale(scales[0], scales[1])
            if is_v:
                kv_scale = _fp8.kv_scale(scales[2], scales[3])
        if cutlass.const_expr(self.k_split > 1):
            cute.arch.mbarrier_wait(recv_bar, 0)  # all partials sent to my tokens by st.async have landed
        if cutlass.const_expr(self.k_split == 1 or self.local_partials):
            # this CTA's own partials, stored by every consumer warp with plain stores
            cute.arch.barrier(barrier_id=BAR_PARTIALS, number_of_threads=CONSUMER_THREADS)
        cute.arch.barrier(barrier_id=BAR_AUX, number_of_threads=CONSUMER_THREADS + 32)
        if cutlass.const_expr(self.fp8):
            kv_scale = _fp8.divisor(kv_scale)  # (scale, 1 / scale, ...): once a thread
        if cutlass.const_expr(self.v.warp_split == "wg" and self.owned >= OCTET_MIN_OWNED):
            # eight lanes a token, 16-byte vectors, where every warp takes a group of four tokens
            # (kernels/qkv_front/octets.py)
            self.finish_octets(recv, cs, slots, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
                               v_block_stride, eps, place, warp_idx, lane, is_qk, is_k, is_v, kv_head, kv_scale)
        else:
            self._finish_pairs(recv, cs, slots, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
                               v_block_stride, eps, place, warp_idx, lane, is_qk, is_k, is_v, kv_head, kv_scale)

    @cute.jit
    def _finish_pairs(self, recv, cs, slots, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
                      v_block_stride, eps, place, warp_idx, lane, is_qk, is_k, is_v, kv_head, kv_scale):
        """The epilogue of the builds with fewer than 16 owned tokens (every mma.sync build, the 3-tile wgmma builds
        at S = 2 and TP8's 6 tiles at S = 4: 12 owned): warp w owns tokens w, w + 4, ...; lane l holds columns
        (2l, 2l+1) = RoPE pair l."""
        head, rank = place.head, place.rank
        mY = cute.make_tensor(y_ptr, cute.make_layout((self.tt, self.n), stride=(self.n, 1)))
        # Every warp owns `rounds` tokens: all their math first (padded tokens t >= M too: their partials are the
        # zero-filled x rows; nothing of them is stored), then the stores. The rounds' shuffle reductions are
        # independent and overlap, instead of one token's latency chain after another (with 16 owned tokens the
        # epilogue was the CTA's tail on an SM no other CTA can use).
        rounds = self.owned // CONSUMER_WARPS
        vals = []
        for jj in cutlass.range_constexpr(rounds):
            vals.append(self._token_values(recv, cs, jj * CONSUMER_WARPS + warp_idx, lane, eps, is_qk))
        for jj in cutlass.range_constexpr(rounds):
            j = jj * CONSUMER_WARPS + warp_idx
            if j * self.k_split + rank < M:
                self._token_store(vals[jj][0], vals[jj][1], mY, slots, kc_ptr, vc_ptr, j, j * self.k_split + rank,
                                  lane, head, kv_head, is_k, is_v, block_size, num_blocks, k_block_stride,
                                  v_block_stride, kv_scale)

    @cute.jit
    def _token_values(self, recv, cs, j, lane, eps, is_qk):
        """bf16 outputs of owned token j for columns (2 lane, 2 lane + 1): partial sum in rank order, bf16
        rounding, then (q, k heads: is_qk) RMS norm over the head and interleaved RoPE."""
        c0 = 2 * lane
        a = Float32(0.0)
        b = Float32(0.0)
        for src in cutlass.range_constexpr(self.k_split):  # fixed rank order: deterministic
            a = a + recv[(src * self.owned + j) * HEAD_COLS + c0]
            b = b + recv[(src * self.owned + j) * HEAD_COLS + c0 + 1]
        # the GEMM result is bf16: every later step works on the rounded value
        a = Float32(BFloat16(a))
        b = Float32(BFloat16(b))
        # Norm and RoPE for every head, then a select (not a branch): the owned tokens' shuffle reductions
        # stay in one basic block, so ptxas can overlap them; v and gate heads keep the rounded sums.
        ss = cute.arch.warp_reduction(a * a + b * b, lambda p, q: p + q)
        r = cute.math.rsqrt(ss * Float32(1.0 / HEAD_COLS) + eps)
        an = a * r
        bn = b * r
        c = cs[j * 64 + lane]
        sn = cs[j * 64 + 32 + lane]
        a = Float32(cutlass.select_(is_qk, an * c - bn * sn, a))
        b = Float32(cutlass.select_(is_qk, an * sn + bn * c, b))
        return BFloat16(a), BFloat16(b)

    @cute.jit
    def _token_store(self, ya, yb, mY, slots, kc_ptr, vc_ptr, j, t, lane, head, kv_head, is_k, is_v, block_size,
                     num_blocks, k_block_stride, v_block_stride, kv_scale):
        """Token t's two columns to y, and (k, v heads) to its cache slot unless the slot is padding (< 0) or
        past the cache (an FP8 build: their two e4m3 bytes of value / kv_scale)."""
        c0 = 2 * lane
        mY[t, head * HEAD_COLS + c0] = ya
        mY[t, head * HEAD_COLS + c0 + 1] = yb
        if is_k or is_v:
            slot = slots[j]
            limit = Int64(num_blocks) * Int64(block_size)
            if slot >= Int64(0) and slot < limit:
                # a 64-bit division is a long software sequence on the k/v heads' tail; caches of < 2^31
                # slots (all real ones) divide in 32 bits, with the same result
                blk = Int64(0)
                if limit <= Int64(0x7FFFFFFF):
                    blk = Int64(Int32(slot) // block_size)
                else:
                    blk = slot // Int64(block_size)
                off = slot - blk * Int64(block_size)
                inner = off * Int64(self.nkv * HEAD_COLS) + Int64(kv_head * HEAD_COLS + c0)
                if cutlass.const_expr(self.fp8):
                    base = vc_ptr + (blk * v_block_stride + inner)
                    if is_k:
                        base = kc_ptr + (blk * k_block_stride + inner)
                    _fp8.store_pair(base.toint(), Float32(ya), Float32(yb), kv_scale)
                elif is_k:
                    dst = cute.make_tensor(kc_ptr + (blk * k_block_stride + inner), cute.make_layout(2))
                    dst[0] = ya
                    dst[1] = yb
                else:
                    dst = cute.make_tensor(vc_ptr + (blk * v_block_stride + inner), cute.make_layout(2))
                    dst[0] = ya
                    dst[1] = yb

    @cute.jit
    def aux(self, st, pos_ptr, cs_ptr, slot_ptr, M, max_pos, place):
        """Stage the owned tokens' slots and cos|sin rows (clamped position) in smem, in two rounds of independent
        loads: lane l reads the position and slot of owned tokens l, l + 32 (indices clamped to M - 1: never a
        read beyond M), then every lane reads its two columns of every owned token's row, the position broadcast
        by a shuffle. (One token after another, two dependent global loads each, took ~0.9 us a token under the
        weight stream and set the pace above 16 owned tokens: bench/NOTES.md "Every M: which path".)"""
        rank = place.rank
        cute.arch.griddepcontrol_wait()  # positions/slots/cos|sin may be written by the previous grid
        lane = cute.arch.lane_idx()
        cs = st.cs.get_tensor(cute.make_layout(self.owned * 64))
        slots = st.slots.get_tensor(cute.make_layout(self.owned))
        mPos = cute.make_tensor(pos_ptr, cute.make_layout(self.tt))
        mSlot = cute.make_tensor(slot_ptr, cute.make_layout(self.tt))
        mCS = cute.make_tensor(cs_ptr, cute.make_layout((max_pos, 64), stride=(64, 1)))
        rows = []
        for r in cutlass.range_constexpr((self.owned + 31) // 32):
            j = r * 32 + lane
            t = cutlass.min(j * self.k_split + rank, M - 1)
            p = mPos[t]
            slot = mSlot[t]
            p = cutlass.max(p, Int64(0))
            p = cutlass.min(p, Int64(max_pos) - Int64(1))
            rows.append(Int32(p))
            if j < self.owned:
                slots[j] = slot
        for j in cutlass.range_constexpr(self.owned):
            p32 = cute.arch.shuffle_sync(rows[j // 32], j % 32)
            cs[j * 64 + lane] = mCS[p32, lane]
            cs[j * 64 + 32 + lane] = mCS[p32, 32 + lane]
        cute.arch.barrier_arrive(barrier_id=BAR_AUX, number_of_threads=CONSUMER_THREADS + 32)


# ---------------------------------------------------------------------- ABI and build
def compile_args(v: QkvFrontVariant) -> tuple:
    """The arguments `QkvFrontKernel.__call__` is compiled with (pointers, scalars of the right types and
    alignment; values do not matter: M is dynamic unless fixed_rows), in `abi_for`'s order."""
    bf = make_ptr(BFloat16, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)
    f32 = make_ptr(Float32, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)
    i64 = make_ptr(Int64, 1 << 20, cute.AddressSpace.gmem, assumed_align=8)
    fp8 = v.kv_cache_dtype != "bf16"
    kv = _fp8.cache_ptr(1 << 20) if fp8 else bf
    w8_args = v.weight_dtype != "bf16"
    e4m3 = make_ptr(Float8E4M3FN, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)
    w = e4m3 if w8_args else bf
    x = e4m3 if v.x_dtype == "fp8_e4m3" else bf
    return (w, x, bf, i64, f32, i64, kv, kv, Int32(max(v.fixed_rows, 1)), Int32(1), Int32(16), Int32(1),
            Int64(1 << 20), Int64(1 << 20), Float32(1e-5), cuda.CUstream(0),
            *((f32,) if w8_args else ()), *((f32,) if v.x_dtype == "fp8_e4m3" else ()),
            *(_fp8.compile_scale_args(1 << 20) if fp8 else ()))


def compile_call(v: QkvFrontVariant, arch: str):
    """(the @cute.jit kernel object, its compile arguments) of `v`; the builder compiles it for `arch` on any machine
    (no GPU needed)."""
    if v.warp_split == "wg" and arch != "sm_90a":
        raise NotImplementedError(f"qkv_front warp_split 'wg' issues wgmma, which only sm_90a has; {arch} takes "
                                  f"'rows' or 'k' (up to 4 token tiles)")
    return QkvFrontKernel(v), compile_args(v)
