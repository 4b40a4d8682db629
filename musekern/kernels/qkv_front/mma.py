"""qkv_front's consumer roles: the MMA over the ring and the delivery of each CTA's partials to their owners.

A mixin of `QkvFrontKernel` (kernel.py, whose docstring has the whole kernel): the methods read
the kernel's static fields (`v`, `tt`, `stages`, `ntiles`, `S`, `owned`). Per `warp_split` (variant.py):
the idle W ring), "wg" issues wgmma m64nTTk16 straight from the swizzled ring as one warpgroup.
"""
# (no `from __future__ import annotations`: @cute.jit reads real annotation objects)

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from . import fp8, w8
from .variant import CONSUMER_WARPS, HEAD_COLS, K_TILE, K_TILES, RED_STRIDE, SCALES_SMEM, WARP_K, X8_CHUNK

CONSUMER_THREADS = 32 * CONSUMER_WARPS
# W8A8 ("wg", e4m3): k-tiles a run of the consumer's loop unrolls, one wgmma group kept in flight within it (ptxas
# serializes every wgmma where a group in flight crosses a loop's back edge: C7514); 8 against the whole loop (64):
# bench/NOTES.md "e4m3 weights"
WG8_RUN = 8
# named barriers (0 is __syncthreads)
BAR_PARTIALS = 1  # S == 1, and "wg" with S > 1: consumers wrote (their own tokens') partials with plain stores
BAR_AUX = 2  # aux warp staged slots and cos|sin rows -> consumer warps (epilogue)
BAR_RED = 3  # warp_split "k": the consumer warps are done with the ring / wrote their partials


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None):
    """Bit-cast fp32 -> i32: st.async payloads are b32 words (NOTES.md pitfall 7)."""
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def operand_copies(tiled_mma, tt: int, idx):
    """ldmatrix tiled copies of the MMA operands and their slices for thread (or lane) idx: x4 for W (A);
    for x (B) per k16 step x4 covers 16 tokens, x2 covers 8."""
    cp_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), BFloat16), tiled_mma)
    cp_b = cute.make_tiled_copy_B(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4 if tt >= 16 else 2), BFloat16), tiled_mma)
    return cp_a, cp_b, cp_a.get_slice(idx), cp_b.get_slice(idx)


class W8State(NamedTuple):
    """An e4m3-weight build's consumer state (w8.py): the W ring's shared address, the x ring as 8-byte words, the
    canonical multipliers, and the per-row ones this thread's partials take ("channel": a register tensor like the
    accumulator ("rows") or one value ("k"); None with block scales)."""
    ring: object
    x64: object
    scales: object  # global; block scales: the CTA's k-tiles' in shared memory, i-th k-tile at i
    row_scales: object


class CtaPlace(NamedTuple):
    """Where a CTA stands (device values, fixed for the launch): its head, its k-split rank r (0..S-1), its member m
    of a head pair (0 without x_mcast; its cluster rank is r + S m) and that pair's other CTA of rank r (x_mcast)."""
    head: object
    rank: object
    member: object
    peer: object


class FrontConsumers:
    """The consumer warps' roles of `QkvFrontKernel` (mixin)."""

    def w8_state(self, st, scale_ptr, tiled_mma, tidx, place):
        """The e4m3-weight consumers' `W8State` (None in a bf16 build); the row scales are loaded here, before the
        first k-tile (weights: no griddepcontrol.wait needed)."""
        if not self.w8:
            return None
        scales = w8.scale_tensor(scale_ptr, self.n)
        rows = None
        if self.block_scales:
            staged = st.wscale.get_tensor(cute.make_layout(SCALES_SMEM))
            self._stage_scales(scales, staged, tidx, place)
            scales = staged
        else:
            if self.v.warp_split in ("rows", "wg"):
                tCcC = tiled_mma.get_slice(tidx).partition_C(
                    cute.make_identity_tensor((16 * CONSUMER_WARPS, self.tt)))
                rows = cute.make_rmem_tensor(cute.size(tCcC), Float32)
                for i in range(cute.size(tCcC)):  # (traced inline: a plain loop unrolls)
                    m, n = tCcC[i]
                    rows[i] = scales[place.head * HEAD_COLS + m]
            else:  # reduce_send: thread tidx sums and sends column tidx % 64 of every token
                rows = scales[place.head * HEAD_COLS + tidx % HEAD_COLS]
        x64 = cute.make_tensor(cute.recast_ptr(st.sX.data_ptr(), dtype=Int64),
                               cute.make_layout(self.stages * self.tt * w8.X_ROW_BYTES // 8))
        return W8State(Int32(st.sW.data_ptr().toint()), x64, scales, rows)

    @cute.jit
    def _stage_scales(self, scales, staged, tidx, place):
        """Block scales: consumer thread i < ntiles copies the multiplier of the CTA's i-th k-tile into shared memory
        (before the first k-tile; weights: no griddepcontrol.wait needed)."""
        if tidx < self.ntiles:
            rot = (place.head - place.head % self.pair) % self.ntiles
            staged[tidx] = scales[place.head * K_TILES + self._k_tile(tidx, place.rank, rot)]
        cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=CONSUMER_THREADS)

    @cute.jit
    def _tile_scale(self, wq, i):
        """Block scales: the multiplier of the i-th k-tile this CTA streams (1.0 otherwise)."""
        sc = Float32(1.0)
        if cutlass.const_expr(self.block_scales):
            sc = wq.scales[i]
        return sc

    @cute.jit
    def consumer(self, tiled_mma, sW, sX, full, empty, tidx, place, wq=None):
        thr_mma = tiled_mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((16 * CONSUMER_WARPS, self.tt)), Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.w8):
            return self._consumer_w8(tiled_mma, thr_mma, acc, sX, full, empty, tidx, place, wq)
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sX[None, None, 0]))
        cp_a, cp_b, thr_a, thr_b = operand_copies(tiled_mma, self.tt, tidx)
        tBsX = thr_b.partition_S(sX)  # (CPY, TT/8 or 1, 8 k-steps, stages)
        tBrB = thr_b.retile(tCrB)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sW[None, None, 0]))
        tAsW = thr_a.partition_S(sW)  # (CPY, 1, 8 k-steps, stages)
        tArA = thr_a.retile(tCrA)
        ksteps = cute.size(tAsW, mode=[2])
        for i in cutlass.range(self.ntiles, unroll=1):
            s = i % self.stages
            cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
            if cutlass.const_expr(self.v.tiles > 2):
                # 4 tiles: one k16 step's operands at a time (a whole k-tile's x fragment takes 64 registers a
                # thread)
                for kk in cutlass.range_constexpr(ksteps):
                    cute.copy(cp_a, tAsW[None, None, kk, s], tArA[None, None, kk])
                    cute.copy(cp_b, tBsX[None, None, kk, s], tBrB[None, None, kk])
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kk], tCrB[None, None, kk], acc)
            else:
                for kk in cutlass.range_constexpr(ksteps):
                    cute.copy(cp_a, tAsW[None, None, kk, s], tArA[None, None, kk])
                    cute.copy(cp_b, tBsX[None, None, kk, s], tBrB[None, None, kk])
                for kk in cutlass.range_constexpr(ksteps):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kk], tCrB[None, None, kk], acc)
            cute.arch.sync_warp()  # every lane's ldmatrix of stage s is done
            self.release(empty + s, place)
        return acc

    @cute.jit
    def _consumer_w8(self, tiled_mma, thr_mma, acc, sX, full, empty, tidx, place, wq):
        """`consumer` of an e4m3 W ring (1 or 2 token tiles): warp w's A registers dequantized from rows 16w.., a
        k-tile's eight k16 steps into two accumulators (even and odd steps: two dependent mma chains of four, not
        one of eight), summed at the end; block scales promote each k-tile's two sums with its multiplier.
        Pipelined over two register sets as consumer_k is: k-tile i + 1 is loaded and converted before the MMAs of
        k-tile i are issued, so its shared loads and conversions overlap the mma chains."""
        rA = [thr_mma.make_fragment_A(thr_mma.partition_shape_A((16 * CONSUMER_WARPS, K_TILE))) for _ in range(2)]
        rB = [thr_mma.make_fragment_B(thr_mma.partition_B(sX[None, None, 0])) for _ in range(2)]
        lane = tidx % 32
        lr = w8.LaneRows(lane)
        odd = cute.make_rmem_tensor(acc.layout, Float32)
        odd.fill(0.0)
        even = acc
        if cutlass.const_expr(self.block_scales):
            even = cute.make_rmem_tensor(acc.layout, Float32)
            even.fill(0.0)
        sc0 = self._load_w8(rA[0], rB[0], full, empty, Int32(0), place, wq, lr, tidx)
        sc1 = sc0
        for p in cutlass.range(self.ntiles // 2, unroll=1):
            i = 2 * p + 1
            sc1 = self._load_w8(rA[1], rB[1], full, empty, i, place, wq, lr, tidx)
            self._mma_w8(tiled_mma, even, odd, rA[0], rB[0])
            if cutlass.const_expr(self.block_scales):
                w8.promote2(acc, even, odd, sc0)
            if i + 1 < self.ntiles:
                sc0 = self._load_w8(rA[0], rB[0], full, empty, i + 1, place, wq, lr, tidx)
            self._mma_w8(tiled_mma, even, odd, rA[1], rB[1])
            if cutlass.const_expr(self.block_scales):
                w8.promote2(acc, even, odd, sc1)
        if cutlass.const_expr(not self.block_scales):
            for k in cutlass.range_constexpr(cute.size(acc)):
                acc[k] = acc[k] + odd[k]
        return acc

    @cute.jit
    def _load_w8(self, rA, rB, full, empty, i, place, wq, lr, tidx):
        """Wait for k-tile i, dequantize this warp's 16 rows of it into rA (w8.load_a2) and load x into rB
        (w8.load_b), release the stage; returns k-tile i's block multiplier (1.0 with channel scales)."""
        s = i % self.stages
        sc = self._tile_scale(wq, i)
        cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
        a32 = cute.recast_tensor(rA, Int32)
        b64 = cute.recast_tensor(rB, Int64)
        lane = tidx % 32
        for kk in cutlass.range_constexpr(0, cute.size(rA, mode=[2]), 2):
            w8.load_a2(wq.ring, a32[None, 0, kk], a32[None, 0, kk + 1], s, 16 * (tidx // 32), lr, kk)
        for kk in cutlass.range_constexpr(cute.size(rA, mode=[2])):
            w8.load_b(wq.x64, b64[None, None, kk], s, lane // 4, lane % 4, kk, self.tt)
        cute.arch.sync_warp()  # every lane's loads of stage s are done (in registers)
        self.release(empty + s, place)
        return sc

    @cute.jit
    def _mma_w8(self, tiled_mma, even, odd, rA, rB):
        for kk in cutlass.range_constexpr(cute.size(rA, mode=[2]) // 2):  # k order fixed within each chain
            cute.gemm(tiled_mma, even, rA[None, None, 2 * kk], rB[None, None, 2 * kk], even)
            cute.gemm(tiled_mma, odd, rA[None, None, 2 * kk + 1], rB[None, None, 2 * kk + 1], odd)

    @cute.jit
    def consumer_wg(self, tiled_mma, sW, sX, full, empty, tidx, place):
        """warp_split "wg": warpgroup 0 issues a k-tile's 8 wgmma m64nTTk16 (W rows x tokens, k order fixed) as one
        group and releases the stage as soon as the group completes: the MMAs (<= 0.15 us a k-tile) are short
        against the stream, so a stage is never held while the next one is waited for (with a group kept in flight
        a ring of S stages would prefetch only S - 1)."""
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))  # (MMA, 1, 8 k16, stages) descriptors
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEAD_COLS, self.tt)), Float32)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        ksteps = cute.size(tCrA, mode=[2])
        for i in cutlass.range(self.ntiles, unroll=1):
            s = i % self.stages
            cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
            warpgroup.fence()
            for kk in cutlass.range_constexpr(ksteps):
                cute.gemm(tiled_mma, acc, tCrA[None, None, kk, s], tCrB[None, None, kk, s], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)  # k-tile i's MMAs have read their stage
            self.release(empty + s, place)
        return acc

    @cute.jit
    def consumer_wg8(self, tiled_mma, st, sW, sX8, full, empty, tidx, place, wq, M):
        """warp_split "wg" with e4m3 weights (W8A8): x's first chunk of X8_CHUNK k-tiles quantized here in place
        (`_quantize_chunk`, warp w its tokens w, w + 4), the later ones by the aux warp meanwhile (`quantizer`, an
        mbarrier a chunk); per k-tile 4 wgmma m64nTTk32 from the W stage and that k-tile's e4m3 x into a partial,
        one group kept in flight within a run of WG8_RUN k-tiles: k-tile i's group is issued before k-tile
        i - 1's is waited for, released and added (acc += part * (the token's x scale * the k-tile's block
        multiplier), in k-tile order: the same sums as one group at a time), so the MMAs' latency overlaps the next
        stage's wait and the scaling. Two partials alternate."""
        assert self.ntiles % min(WG8_RUN, self.ntiles) == 0
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))  # (MMA, 1, 4 k32, stages) descriptors
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX8))  # (MMA, 1, 4 k32, 2 x k-tiles)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEAD_COLS, self.tt)), Float32)
        acc.fill(0.0)
        parts = (cute.make_rmem_tensor(acc.layout, Float32), cute.make_rmem_tensor(acc.layout, Float32))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((HEAD_COLS, self.tt)))
        xs = st.xs.get_tensor(cute.make_layout(self.ntiles * self.tt))
        if cutlass.const_expr(self.x8_ahead):
            cute.arch.mbarrier_wait(st.cfull.data_ptr(), 0)  # x quantized ahead: its scales staged (`stage_x_scales`)
        else:
            cute.arch.mbarrier_wait(st.xfull.data_ptr(), 0)  # chunk 0's x landed
            self._quantize_chunk(st, xs, Int32(0), tidx // 32, CONSUMER_WARPS, self.tt // CONSUMER_WARPS, M)
            cute.arch.fence_proxy("async.shared", space="cta")  # the generic stores, before wgmma reads them
            cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=CONSUMER_THREADS)
        run = min(WG8_RUN, self.ntiles)
        for c in cutlass.range(self.ntiles // run, unroll=1):
            for h in cutlass.range_constexpr(run):
                i = c * run + h
                s = self._wait_wg8(st, full, i)
                warpgroup.fence()
                for kk in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):  # (inline: tiled_mma is rebound)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
                    cute.gemm(tiled_mma, parts[h % 2], tCrA[None, None, kk, s],
                              tCrB[None, None, kk, (2 - self.x8_ahead) * i], parts[h % 2])
                warpgroup.commit_group()
                if cutlass.const_expr(h > 0):
                    warpgroup.wait_group(1)  # k-tile i - 1's MMAs completed (i's in flight)
                    self._retire_wg8(acc, parts[(h - 1) % 2], xs, tCcC, empty, place, wq, i - 1)
            warpgroup.wait_group(0)  # the run's last k-tile (no group crosses the loop's back edge: ptxas would
            self._retire_wg8(acc, parts[(run - 1) % 2], xs, tCcC, empty, place, wq, c * run + run - 1)  # serialize
        return acc

    @cute.jit
    def _wait_wg8(self, st, full, i):
        """W8A8: wait for k-tile i's x chunk (at its first k-tile) and W stage; its stage."""
        s = i % self.stages
        if cutlass.const_expr(self.x8_ahead):
            if i % X8_CHUNK == 0:
                cute.arch.mbarrier_wait(st.xfull.data_ptr() + i // X8_CHUNK, 0)  # the chunk's e4m3 x landed
        elif i % X8_CHUNK == 0 and i > 0:
            cute.arch.mbarrier_wait(st.cfull.data_ptr() + i // X8_CHUNK, 0)
        cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
        return s

    @cute.jit
    def _retire_wg8(self, acc, part, xs, tCcC, empty, place, wq, i):
        """W8A8: k-tile i's MMAs completed: release its stage, acc += part * (x scale * block multiplier)."""
        self.release(empty + i % self.stages, place)
        sc = self._tile_scale(wq, i)
        for e in cutlass.range_constexpr(cute.size(part)):
            m, n = tCcC[e]
            acc[e] = acc[e] + part[e] * (xs[i * self.tt + n] * sc)

    @cute.jit
    def quantizer(self, st, M):
        """W8A8, the aux warp: once all of the CTA's x has landed, chunks 1.. of X8_CHUNK k-tiles (`_quantize_chunk`,
        four tokens at a time), each followed by cfull[chunk]; the consumers quantize chunk 0 meanwhile."""
        xs = st.xs.get_tensor(cute.make_layout(self.ntiles * self.tt))
        cfull = st.cfull.data_ptr()
        for ch in cutlass.range(1, self.ntiles // X8_CHUNK, unroll=1):
            cute.arch.mbarrier_wait(st.xfull.data_ptr() + ch, 0)  # its x landed
            for r0 in cutlass.range_constexpr(0, self.tt, 4):
                self._quantize_chunk(st, xs, ch, Int32(r0), 1, 4, M)
            cute.arch.fence_proxy("async.shared", space="cta")  # the generic stores, before wgmma reads them
            cute.arch.mbarrier_arrive(cfull + ch)  # every lane (count 32): each releases its own stores

    @cute.jit
    def stage_x_scales(self, st, xs_ptr, M, place):
        """x quantized ahead (x_quant group 128: s[r, k] at k M + r), the aux warp after `aux`'s griddepcontrol.wait:
        xs[i * tt + r] = the scale of token r in the CTA's k-tile i (tokens >= M: 0), then every lane arrives on
        cfull[0]."""
        xs = st.xs.get_tensor(cute.make_layout(self.ntiles * self.tt))
        mS = cute.make_tensor(xs_ptr, cute.make_layout(K_TILES * M))
        lane = cute.arch.lane_idx()
        rot = (place.head - place.head % self.pair) % self.ntiles
        for e0 in cutlass.range_constexpr(0, self.ntiles * self.tt, 32):
            e = e0 + lane
            r = e % self.tt
            v = Float32(0.0)
            if r < M:
                v = mS[self._k_tile(e // self.tt, place.rank, rot) * M + r]
            xs[e] = v
        cute.arch.mbarrier_arrive(st.cfull.data_ptr())

    @cute.jit
    def _quantize_chunk(self, st, xs, ch, r0, rstep: cutlass.Constexpr, nrows: cutlass.Constexpr, M):
        """Tokens r0, r0 + rstep, .. (nrows of them, those < M) of chunk ch's X8_CHUNK k-tiles (k-tile i in x slot i:
        tt tokens x 128 bf16, swizzled; rows >= M zero) -> e4m3 in place (the first tt x 128 bytes of the slot, an
        e4m3 tile's 128B swizzle), xs[i * tt + token] = its scale, vLLM's per-token-group one (fp8.group_scale; tokens
        >= M: 0). Lane l takes k-tile l / 4 of the chunk, columns 32 (l % 4) .. + 31, all the
        tokens at once (their latencies overlap); a (token, k-tile)'s 4 lanes read all their values before any
        writes (a lane's bytes overwrite another's input)."""
        lane = cute.arch.lane_idx()
        q = lane % 4
        x64 = cute.make_tensor(cute.recast_ptr(st.sX.data_ptr(), dtype=Int64),
                               cute.make_layout(self.ntiles * self.tt * w8.X_ROW_BYTES // 8))
        q32 = cute.make_tensor(cute.recast_ptr(st.sX.data_ptr(), dtype=Int32),
                               cute.make_layout(self.ntiles * self.tt * w8.X_ROW_BYTES // 4))
        i = ch * X8_CHUNK + lane // 4
        v = cute.make_rmem_tensor(cute.make_layout(8 * nrows), Int64)
        v.fill(0)
        for k in cutlass.range_constexpr(nrows):
            r = r0 + rstep * k
            if r < M:
                for h in cutlass.range_constexpr(4):  # bf16 chunk c = 4q + h: columns 8c .. 8c + 7
                    c = 4 * q + h
                    src = w8.x8_src(i, r, c, self.tt)
                    v[8 * k + 2 * h] = x64[src // 8]
                    v[8 * k + 2 * h + 1] = x64[src // 8 + 1]
        w = cute.recast_tensor(v, Int32)
        amax = []
        for k in cutlass.range_constexpr(nrows):
            a = w8.amax_bf16x4x2(w[16 * k], w[16 * k + 1], w[16 * k + 2], w[16 * k + 3])
            for h in cutlass.range_constexpr(1, 4):
                a = cute.arch.fmax(a, w8.amax_bf16x4x2(w[16 * k + 4 * h], w[16 * k + 4 * h + 1],
                                                       w[16 * k + 4 * h + 2], w[16 * k + 4 * h + 3]))
            amax.append(a)
        for b in cutlass.range_constexpr(2):
            for k in cutlass.range_constexpr(nrows):
                amax[k] = cute.arch.fmax(amax[k], cute.arch.shuffle_sync_bfly(amax[k], offset=1 << b))
        cute.arch.sync_warp()  # every lane's values are in registers (amax used them): now overwrite
        for k in cutlass.range_constexpr(nrows):
            r = r0 + rstep * k
            if r < M:
                sc = fp8.group_scale(amax[k])
                inv = fp8.rcp_rn(sc)
                for h in cutlass.range_constexpr(2):  # e4m3 chunk 2q + h: columns 32q + 16h .. + 15
                    dst = w8.x8_dst(i, r, 2 * q + h, self.tt)
                    for kk in cutlass.range_constexpr(4):
                        base = 16 * k + 8 * h + 2 * kk
                        q32[dst // 4 + kk] = w8.scaled_e4m3x4(w[base], w[base + 1], inv)
                if q == 0:
                    xs[i * self.tt + r] = sc
            else:
                if q == 0:
                    xs[i * self.tt + r] = Float32(0.0)

    @cute.jit
    def consumer_k(self, tiled_mma, sW, sX, full, empty, warp_idx, lane, place, wq=None):
        """warp_split "k": this warp's two k16 steps (columns 32w..32w+31) of every stage, all 64 rows.

        Per stage a warp loads 4 A tiles and 1 B tile per k16 step (x is read once per CTA, not once per
        warp) and releases the stage as soon as its operands are in registers. Software-pipelined over
        two register sets: the MMAs of stage i-1 are issued after the loads of stage i, so ldmatrix latency
        overlaps 4 x tiles independent MMA chains (without it ptxas serialises ldmatrix -> mma)."""
        thr_mma = tiled_mma.get_slice(lane)
        mine_x = cute.local_tile(sX[None, None, 0], (self.tt, WARP_K), (0, 0))  # shapes of one warp's slice
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((HEAD_COLS, self.tt)), Float32)
        acc.fill(0.0)
        cp_a, cp_b, thr_a, thr_b = operand_copies(tiled_mma, self.tt, lane)
        tBsX = thr_b.partition_S(sX)  # (CPY, 1, 8 k16, stages)
        # two register sets (even / odd k-tiles): (MMA, 4 m16, 2 k16) and (MMA, 1, 2 k16) each
        rB = [thr_mma.make_fragment_B(thr_mma.partition_B(mine_x)) for _ in range(2)]
        if cutlass.const_expr(self.w8):
            rA = [thr_mma.make_fragment_A(thr_mma.partition_shape_A((HEAD_COLS, WARP_K))) for _ in range(2)]
            return self._consumer_k_w8(tiled_mma, acc, rA, rB, full, empty, warp_idx, lane, place, wq)
        mine_w = cute.local_tile(sW[None, None, 0], (HEAD_COLS, WARP_K), (0, 0))
        tAsW = thr_a.partition_S(sW)  # (CPY, 4 m16, 8 k16, stages)
        rA = [thr_mma.make_fragment_A(thr_mma.partition_A(mine_w)) for _ in range(2)]
        if cutlass.const_expr(self.v.tiles > 2):
            # 4 tiles: 64 accumulators a thread leave no room for a second register set (two CTAs per SM)
            for i in cutlass.range(self.ntiles, unroll=1):
                self._load_k(cp_a, cp_b, thr_a, thr_b, tAsW, tBsX, rA[0], rB[0], full, empty, warp_idx, i, place)
                self._mma_k(tiled_mma, acc, rA[0], rB[0])
        else:
            self._load_k(cp_a, cp_b, thr_a, thr_b, tAsW, tBsX, rA[0], rB[0], full, empty, warp_idx, Int32(0), place)
            for p in cutlass.range(self.ntiles // 2, unroll=1):
                i = 2 * p + 1
                self._load_k(cp_a, cp_b, thr_a, thr_b, tAsW, tBsX, rA[1], rB[1], full, empty, warp_idx, i, place)
                self._mma_k(tiled_mma, acc, rA[0], rB[0])
                if i + 1 < self.ntiles:
                    self._load_k(cp_a, cp_b, thr_a, thr_b, tAsW, tBsX, rA[0], rB[0], full, empty, warp_idx, i + 1,
                                     place)
                self._mma_k(tiled_mma, acc, rA[1], rB[1])
        return acc

    @cute.jit
    def _consumer_k_w8(self, tiled_mma, acc, rA, rB, full, empty, warp_idx, lane, place, wq):
        """`consumer_k` of an e4m3 W ring (1 or 2 token tiles), pipelined the same way over two register sets; with
        block scales each k-tile's two k16 steps go to `part`, promoted into acc with that k-tile's multiplier."""
        lr = w8.LaneRows(lane)
        part = acc
        if cutlass.const_expr(self.block_scales):
            part = cute.make_rmem_tensor(acc.layout, Float32)
            part.fill(0.0)
        sc0 = self._load_k_w8(rA[0], rB[0], full, empty, warp_idx, Int32(0), place, wq, lr, lane)
        sc1 = sc0
        for p in cutlass.range(self.ntiles // 2, unroll=1):
            i = 2 * p + 1
            sc1 = self._load_k_w8(rA[1], rB[1], full, empty, warp_idx, i, place, wq, lr, lane)
            self._mma_k(tiled_mma, part, rA[0], rB[0])
            if cutlass.const_expr(self.block_scales):
                w8.promote(acc, part, sc0)
            if i + 1 < self.ntiles:
                sc0 = self._load_k_w8(rA[0], rB[0], full, empty, warp_idx, i + 1, place, wq, lr, lane)
            self._mma_k(tiled_mma, part, rA[1], rB[1])
            if cutlass.const_expr(self.block_scales):
                w8.promote(acc, part, sc1)
        return acc

    @cute.jit
    def _load_k_w8(self, rA, rB, full, empty, warp_idx, i, place, wq, lr, lane):
        """`_load_k` from an e4m3 ring: this warp's 4 m16 x 2 k16 A blocks dequantized (an ldmatrix.x4 each,
        w8.load_a2) and its two k16 steps of x (w8.load_b); returns k-tile i's block multiplier (1.0 with channel
        scales)."""
        s = i % self.stages
        sc = self._tile_scale(wq, i)
        cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
        a32 = cute.recast_tensor(rA, Int32)
        b64 = cute.recast_tensor(rB, Int64)
        kk = warp_idx * (WARP_K // 16)
        for mi in cutlass.range_constexpr(HEAD_COLS // 16):
            w8.load_a2(wq.ring, a32[None, mi, 0], a32[None, mi, 1], s, 16 * mi, lr, kk)
        for j in cutlass.range_constexpr(WARP_K // 16):
            w8.load_b(wq.x64, b64[None, None, j], s, lane // 4, lane % 4, kk + j, self.tt)
        cute.arch.sync_warp()  # every lane's loads of stage s are done
        self.release(empty + s, place)
        return sc

    @cute.jit
    def _load_k(self, cp_a, cp_b, thr_a, thr_b, tAsW, tBsX, rA, rB, full, empty, warp_idx, i, place):
        """Wait for k-tile i, load this warp's operands of it, release its stage to the producer."""
        s = i % self.stages
        cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
        tArA = thr_a.retile(rA)
        tBrB = thr_b.retile(rB)
        for j in cutlass.range_constexpr(WARP_K // 16):
            kk = warp_idx * (WARP_K // 16) + j
            cute.copy(cp_a, tAsW[None, None, kk, s], tArA[None, None, j])
            cute.copy(cp_b, tBsX[None, None, kk, s], tBrB[None, None, j])
        cute.arch.sync_warp()  # every lane's ldmatrix of stage s is done: the producer may refill it
        self.release(empty + s, place)

    @cute.jit
    def release(self, bar, place):
        """This warp is done with a stage: one lane arrives on its empty barrier, and (x_mcast) on the pair's
        other head's, whose producer multicasts into this ring too."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(bar)
            if cutlass.const_expr(self.v.x_mcast):
                cute.arch.mbarrier_arrive(bar, place.peer)

    @cute.jit
    def _mma_k(self, tiled_mma, acc, rA, rB):
        for j in cutlass.range_constexpr(WARP_K // 16):  # k order fixed: j = 0, 1 of each k-tile
            cute.gemm(tiled_mma, acc, rA[None, None, j], rB[None, None, j], acc)

    @cute.jit
    def reduce_send(self, tiled_mma, acc, st, recv_bar, warp_idx, tidx, place, wq=None):
        """warp_split "k": sum the 4 warps' partials in warp order 0..3 (in the idle W ring), then each of the
        128 consumer threads sends TT/2 of the CTA's 64 x TT sums to their owners (as `send` does)."""
        red = cute.make_tensor(cute.recast_ptr(st.sW.data_ptr(), dtype=Float32),
                               cute.make_layout(CONSUMER_WARPS * self.tt * RED_STRIDE))
        recv = self.recv(st)
        thr_mma = tiled_mma.get_slice(tidx % 32)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((HEAD_COLS, self.tt)))
        # every consumer warp has read its last stage (and every TMA write has landed: each was waited on)
        cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=CONSUMER_THREADS)
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[i]
            red[(warp_idx * self.tt + n) * RED_STRIDE + m] = acc[i]
        cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=CONSUMER_THREADS)
        for e in cutlass.range_constexpr(self.tt * HEAD_COLS // CONSUMER_THREADS):
            idx = tidx + e * CONSUMER_THREADS  # consecutive threads: consecutive columns (no bank conflicts)
            n = idx // HEAD_COLS
            m = idx % HEAD_COLS
            total = red[n * RED_STRIDE + m]
            for w in cutlass.range_constexpr(1, CONSUMER_WARPS):  # fixed warp order: deterministic
                total = total + red[(w * self.tt + n) * RED_STRIDE + m]
            if cutlass.const_expr(self.w8 and not self.block_scales):
                total = total * wq.row_scales  # column tidx % 64's multiplier (w8_state)
            self._deliver(recv, recv_bar, place, n, m, total)

    @cute.jit
    def send(self, tiled_mma, acc, st, recv_bar, tidx, place, wq=None):
        """warp_split "rows" and "wg": every accumulator element is a whole partial of (column m, token n) (no
        cross-warp sum): deliver it."""
        thr_mma = tiled_mma.get_slice(tidx)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((16 * CONSUMER_WARPS, self.tt)))
        recv = self.recv(st)
        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[i]
            if cutlass.const_expr(self.w8 and not self.block_scales):
                self._deliver(recv, recv_bar, place, n, m, acc[i] * wq.row_scales[i])
            else:
                self._deliver(recv, recv_bar, place, n, m, acc[i])

    @cute.jit
    def _deliver(self, recv, recv_bar, place, n, m, value):
        """This CTA's partial of (column m, token n) to the owner, rank n % S of this head (cluster rank
        n % S + S member), at recv[rank][n // S][m]: st.async into the owner's shared memory (completes on its
        receive barrier), or a plain store with S == 1 and, in the "wg" builds, for this CTA's own tokens."""
        if cutlass.const_expr(self.k_split == 1):
            recv[n * HEAD_COLS + m] = value
        else:
            off = (place.rank * self.owned + n // self.k_split) * HEAD_COLS + m
            owner = n % self.k_split + self.k_split * place.member  # (member 0 without x_mcast)
            if cutlass.const_expr(self.local_partials):
                if n % self.k_split == place.rank:
                    recv[off] = value  # my own token: a plain store (finish's BAR_PARTIALS orders it)
                else:
                    cute.arch.store_async_dsmem(recv.iterator + off, f32_bits(value), recv_bar, owner)
            else:
                cute.arch.store_async_dsmem(recv.iterator + off, f32_bits(value), recv_bar, owner)
