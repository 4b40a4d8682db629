"""qkv_epilogue, bulk build: the same contract as kernels/qkv_epilogue.py, its rows of y staged in shared memory.

The register builds hold every byte in flight in registers (16 B x vecs_per_thread a thread, then a second,
position-dependent cos|sin latency), so an SM has 32-48 KiB of loads in flight for part of each thread's life.
Here warp 0 (the producer) copies whole rows instead: per row one cp.async.bulk of its q | k | v heads (the gate
heads are never read) and one of the cos|sin row its clamped position selects, into a ring of EPI_BULK_STAGES
stages of `rows` rows (variants/qkv_epilogue.py: bulk_rows), counted on the stage's full mbarrier. Up to three
stages (~55 KiB) a CTA, three CTAs an SM, are in flight with no register holding them.

The `bulk` consumer warps split a stage's rows, wpr = max(1, warps // rows) warps a row. Per row a lane reads the
row's slot from global memory (an L1 hit: the producer prefetched the line into the SM's L1) and its cos|sin pieces
(lane j = lane % 8 of every head) from shared memory once; then the row's warp steps, vecs_per_thread at a time: in
step t lane l takes vector 32 t + l of the row (head (32 t + l) // 8) from shared memory, 1 / rms by butterfly
shuffles over the head's 8 lanes, RoPE, and 16-byte stores of y (q, k heads) and of the cache rows (k normed and
roped, v as loaded) straight to global memory. The math is the register builds' (`QkvEpilogueKernel._inv_rms`,
`_roped`), so the results are theirs bit for bit; the per-vector index and address work is what this layout saves
(a vector's unit decomposition, slot division and cos|sin loads are per row here). Each consumer warp releases the
stage on its empty mbarrier once its last shared-memory read of it is done. Lanes past the row's last vector, and
rows past M in the last stage, read stale shared memory and store nothing (every lane runs the shuffles).

A CTA takes a contiguous run of row blocks (grid = min(blocks, EPI_BULK_MAX_CTAS); blocks // grid each, one more for
the first blocks % grid CTAs): consecutive stages share their position and slot lines. PDL as the register
builds: every thread waits (griddepcontrol.wait) before its first global read, then launches dependents.
"""
# (no `from __future__ import annotations`: @cute.jit reads real annotation objects)

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ..variants.qkv_epilogue import (
    EPI_BULK_CTAS_PER_SM,
    EPI_BULK_MAX_CTAS,
    EPI_BULK_MAX_ROWS,
    EPI_BULK_SMEM_BYTES,
    EPI_BULK_STAGE_BYTES,
    EPI_BULK_STAGE_Y_BYTES,
    EPI_BULK_STAGES,
    EPI_HEAD_DIM,
    EPI_LANES,
    EPI_VEC_ELEMS,
    QkvEpilogueVariant,
)
from .qkv_epilogue import QkvEpilogueKernel

_VEC = EPI_VEC_ELEMS
_CS_ROW = EPI_HEAD_DIM  # float32 of a cos|sin row: 32 cos, 32 sin
_CS_BYTES = _CS_ROW * 4
_ROW_HEAD_BYTES = EPI_HEAD_DIM * 2
# offsets inside a stage (bytes): y rows, then cos|sin rows
_CS_OFF = EPI_BULK_STAGE_Y_BYTES
_BAR_OFF = EPI_BULK_STAGES * EPI_BULK_STAGE_BYTES  # full[STAGES], then empty[STAGES]
assert EPI_LANES == 8 and EPI_BULK_STAGE_BYTES % 16 == 0
assert _CS_OFF + EPI_BULK_MAX_ROWS * _CS_BYTES == EPI_BULK_STAGE_BYTES


@dsl_user_op
def _bulk_g2s(dst: Int32, src: Int64, nbytes: Int32, bar: Int32, *, loc=None, ip=None):
    """cp.async.bulk global -> this CTA's shared memory, its bytes completing on mbarrier `bar` (both shared
    addresses of this CTA; size and addresses 16-byte multiples)."""
    llvm.inline_asm(None, [Int32(dst).ir_value(loc=loc, ip=ip), Int64(src).ir_value(loc=loc, ip=ip),
                           Int32(nbytes).ir_value(loc=loc, ip=ip), Int32(bar).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                    "r,l,r,r,~{memory}", has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _prefetch_l1(addr: Int64, *, loc=None, ip=None):
    """prefetch.global.L1 [addr]: the line comes into this SM's L1 (the consumers' slot loads then hit it)."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)], "prefetch.global.L1 [$0];", "l",
                    has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


class QkvEpilogueBulkKernel(QkvEpilogueKernel):
    """The bulk build (a unit is vecs_per_thread heads' lane j: the register builds' math)."""

    def __init__(self, v: QkvEpilogueVariant):
        assert v.bulk and v.rounds == 1
        super().__init__(v)
        self.warps = v.bulk  # consumer warps
        self.consumers = 32 * v.bulk

    @cute.jit
    def __call__(self, y: cute.Pointer, positions: cute.Pointer, cos_sin: cute.Pointer, slots: cute.Pointer,
                 kc: cute.Pointer, vc: cute.Pointer, m: Int32, nq: Int32, nkv: Int32, ld_y: Int32, max_pos: Int32,
                 block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64, eps: Float32,
                 stream: cuda.CUstream):
        """The launch CuTe would do (the loader reproduces it from the manifest and variants' launch_grid)."""
        rows = cutlass.min(EPI_BULK_MAX_ROWS, EPI_BULK_STAGE_Y_BYTES // ((nq + 2 * nkv) * _ROW_HEAD_BYTES))
        grid_x = cutlass.min((m + (rows - 1)) // rows, EPI_BULK_MAX_CTAS)
        self.kernel(y, positions, cos_sin, slots, kc, vc, m, nq, nkv, ld_y, max_pos, block_size, num_blocks,
                    k_block_stride, v_block_stride, eps).launch(grid=[grid_x, 1, 1],
                                                                block=[32 * (1 + self.warps), 1, 1],
                                                                smem=EPI_BULK_SMEM_BYTES, stream=stream, use_pdl=True,
                                                                min_blocks_per_mp=EPI_BULK_CTAS_PER_SM,
                                                                preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, y: cute.Pointer, positions: cute.Pointer, cos_sin: cute.Pointer, slots: cute.Pointer,
               kc: cute.Pointer, vc: cute.Pointer, m: Int32, nq: Int32, nkv: Int32, ld_y: Int32, max_pos: Int32,
               block_size: Int32, num_blocks: Int32, k_block_stride: Int64, v_block_stride: Int64, eps: Float32):
        tidx = cute.arch.thread_idx()[0]
        bidx = cute.arch.block_idx()[0]
        grid = cute.arch.grid_dim()[0]
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        heads = nq + 2 * nkv
        row_bytes = heads * _ROW_HEAD_BYTES
        rows = cutlass.min(EPI_BULK_MAX_ROWS, EPI_BULK_STAGE_Y_BYTES // row_bytes)
        blocks = (m + (rows - 1)) // rows
        # this CTA's row blocks: a contiguous run (so consecutive stages share their position and slot lines),
        # blocks // grid of them, one more for the first blocks % grid CTAs
        base_n = blocks // grid
        extra = blocks - base_n * grid
        mine = base_n + cutlass.select_(bidx < extra, 1, 0)
        first = bidx * base_n + cutlass.min(bidx, extra)

        base = cute.arch.get_dyn_smem(Uint8, alignment=128)
        full = cute.recast_ptr(base + _BAR_OFF, dtype=Int64)
        empty = full + EPI_BULK_STAGES
        if tidx == 0:
            for s in cutlass.range_constexpr(EPI_BULK_STAGES):
                cute.arch.mbarrier_init(full + s, 1)  # the producer's expect_tx arrive; the bytes complete it
                cute.arch.mbarrier_init(empty + s, self.warps)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        cute.arch.griddepcontrol_wait()  # before any global read: y is the previous grid's output
        cute.arch.griddepcontrol_launch_dependents()
        if warp == 0:
            self._produce(base, full, empty, y, positions, cos_sin, slots, m, ld_y, max_pos, row_bytes, rows, first,
                          mine)
        else:
            self._consume(base, full, empty, y, slots, kc, vc, m, nq, nkv, heads, ld_y, block_size, num_blocks,
                          k_block_stride, v_block_stride, eps, rows, first, mine, tidx - 32)

    @cute.jit
    def _produce(self, base, full, empty, y, positions, cos_sin, slots, m, ld_y, max_pos, row_bytes, rows, first,
                 mine):
        """Warp 0: each of its row blocks into the next stage; lane l < the block's live rows copies row l."""
        lane = cute.arch.lane_idx()
        mPos = cute.make_tensor(positions, cute.make_layout(m))
        y0 = y.toint()
        cs0 = cos_sin.toint()
        smem0 = base.toint()
        for it in cutlass.range(mine, unroll=1):
            s = it % EPI_BULK_STAGES
            r0 = (first + it) * rows
            live = cutlass.min(rows, m - r0)
            r = r0 + cutlass.min(lane, live - 1)  # (lanes past the live rows read the last one's, in bounds)
            pos = mPos[r]  # issued before the empty wait: its latency passes while the ring is full
            # two stages ahead, the lines of the positions and slots (of this stage: the consumers' slot loads)
            r2 = cutlass.min(r + 2 * rows, m - 1)
            _prefetch_l1(positions.toint() + Int64(r2) * 8)
            _prefetch_l1(slots.toint() + Int64(r) * 8)
            if it >= EPI_BULK_STAGES:  # use u = it // STAGES of stage s: wait until the consumers released u - 1
                cute.arch.mbarrier_wait(empty + s, ((it // EPI_BULK_STAGES) - 1) % 2)
            stage = smem0 + s * EPI_BULK_STAGE_BYTES
            bar = Int32((full + s).toint())
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full + s, live * (row_bytes + _CS_BYTES))
            if lane < live:
                _bulk_g2s(Int32(stage + lane * row_bytes), Int64(y0) + Int64(r) * Int64(ld_y) * 2, row_bytes, bar)
                p = Int32(cutlass.min(cutlass.max(pos, Int64(0)), Int64(max_pos) - Int64(1)))
                _bulk_g2s(Int32(stage + _CS_OFF + lane * _CS_BYTES), Int64(cs0) + Int64(p) * _CS_BYTES, _CS_BYTES,
                          bar)

    @cute.jit
    def _consume(self, base, full, empty, y, slots, kc, vc, m, nq, nkv, heads, ld_y, block_size, num_blocks,
                 k_block_stride, v_block_stride, eps, rows, first, mine, ctid):
        """Warps 1..: a stage's rows, `wpr` warps a row (the warps split over the rows so that none idles where the
        stage has fewer rows than warps); per row, its slot, cache offsets and lane j's cos|sin once, then the row's
        warp steps (32 vectors a step: lane l takes vector 32 step + l, head (32 step + l) // 8, lane j = l % 8)
        vecs_per_thread at a time. A warp releases the stage after its last read of it."""
        lane = cute.arch.lane_idx()
        wi = ctid // 32
        j = lane % EPI_LANES
        mY = cute.make_tensor(y, cute.make_layout((m, heads * EPI_LANES, _VEC),
                                                  stride=(cute.assume(Int64(ld_y), divby=_VEC), _VEC, 1)))
        mSlot = cute.make_tensor(slots, cute.make_layout(m))
        block_vecs = block_size * nkv * EPI_LANES  # 16-byte vectors of one cache block
        mK = cute.make_tensor(kc, cute.make_layout((num_blocks, block_vecs, _VEC),
                                                   stride=(cute.assume(k_block_stride, divby=_VEC), _VEC, 1)))
        mV = cute.make_tensor(vc, cute.make_layout((num_blocks, block_vecs, _VEC),
                                                   stride=(cute.assume(v_block_stride, divby=_VEC), _VEC, 1)))
        y_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        sY = cute.make_tensor(cute.recast_ptr(base, dtype=BFloat16),
                              cute.make_layout((EPI_BULK_STAGES, EPI_BULK_STAGE_Y_BYTES // 16, _VEC),
                                               stride=(EPI_BULK_STAGE_BYTES // 2, _VEC, 1)))
        sCS = cute.make_tensor(cute.recast_ptr(base + _CS_OFF, dtype=Float32),
                               cute.make_layout((EPI_BULK_STAGES, EPI_BULK_MAX_ROWS, 2 * EPI_LANES, 4),
                                                stride=(EPI_BULK_STAGE_BYTES // 4, _CS_ROW, 4, 1)))
        row_vecs = heads * EPI_LANES
        steps = (row_vecs + 31) // 32  # warp steps of a row
        wpr = cutlass.max(1, self.warps // rows)  # warps a row
        groups = self.warps // wpr  # rows worked at once
        wr = wi // wpr  # this warp's first row of a stage
        ws = wi - wr * wpr  # and its first step of a row
        limit = Int64(num_blocks) * Int64(block_size)
        for it in cutlass.range(mine, unroll=1):
            s = it % EPI_BULK_STAGES
            r0 = (first + it) * rows
            live_rows = cutlass.min(rows, m - r0)
            cute.arch.mbarrier_wait(full + s, (it // EPI_BULK_STAGES) % 2)
            for rr in cutlass.range(wr, rows, groups, unroll=1):
                row_live = rr < live_rows
                r = cutlass.min(r0 + rr, m - 1)  # (a dead row of the last stage: its slot read stays in bounds)
                slot = mSlot[r]  # an L1 hit: the producer prefetched the line
                cached = row_live and slot >= Int64(0) and slot < limit
                s32 = Int32(cutlass.min(cutlass.max(slot, Int64(0)), limit - Int64(1)))  # < 2^31: the op checks it
                blk = s32 // block_size
                vec0 = (s32 - blk * block_size) * nkv * EPI_LANES + j
                cos_f = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                sin_f = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                cute.autovec_copy(sCS[s, rr, j, None], cos_f)
                cute.autovec_copy(sCS[s, rr, EPI_LANES + j, None], sin_f)
                for st in cutlass.range(ws, steps, wpr * self.vpt, unroll=1):
                    frags = []
                    idxs = []
                    for q in cutlass.range_constexpr(self.vpt):
                        # a lane past the row's last vector reads the last one (its 8-lane group is all past: dead)
                        idx = (st + q * wpr) * 32 + lane
                        idxs.append(idx)
                        f = cute.make_rmem_tensor(cute.make_layout(_VEC), BFloat16)
                        cute.autovec_copy(sY[s, rr * row_vecs + cutlass.min(idx, row_vecs - 1), None], f)
                        frags.append(f)
                    rs = self._inv_rms(frags, eps)
                    for q in cutlass.range_constexpr(self.vpt):
                        idx = idxs[q]
                        hk = (idx >> 3) - nq  # idx // EPI_LANES - nq: the k head, if 0 <= hk < nkv
                        hv = hk - nkv  # the v head, if 0 <= hv < nkv (a lane past the row's end has hv >= nkv)
                        o = self._roped(frags[q].load().to(Float32), rs[q], cos_f, sin_f)
                        # three independent predicated stores (no branches): y for q, k heads, then the caches
                        if row_live and hk < nkv:
                            cute.copy(y_copy, o, mY[r, idx, None])
                        if cached and hk >= 0 and hk < nkv:
                            cute.copy(y_copy, o, mK[blk, vec0 + hk * EPI_LANES, None])
                        if cached and hv >= 0 and hv < nkv:
                            cute.copy(y_copy, frags[q], mV[blk, vec0 + hv * EPI_LANES, None])
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(empty + s)
