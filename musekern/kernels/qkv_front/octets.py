"""qkv_front's owner epilogue for the wgmma builds with 16 owned tokens or more: eight lanes a token, 16-byte accesses.

A mixin of `QkvFrontKernel` (kernel.py, whose docstring has the whole kernel): the method reads
the kernel's static fields (`n`, `tt`, `S`, `owned`, `nkv`). The owner's tokens are taken four at a time by a warp:
lane l works on token 4 g + l // 8 of group g (warp w takes groups w, w + 4, ...), columns 8 (l % 8) .. + 7 = RoPE pairs
4 (l % 8) .. + 3. Its partials, cos|sin and stores are 16-byte vectors; the RMS norm's sum is the lane's 8 squares then
three butterfly rounds among the token's 8 lanes. Same math and rounding steps as the one-pair-a-lane epilogue of the
builds with fewer owned tokens (`QkvFrontKernel._token_values`); the sum of squares is added in another order.
"""
# (no `from __future__ import annotations`: @cute.jit reads real annotation objects)

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from . import fp8 as _fp8
from .variant import CONSUMER_WARPS, HEAD_COLS

OCT = 8  # columns a lane (16 bytes of bf16), lanes a token
QUAD = 4  # fp32 a 16-byte vector
TOKENS_A_WARP = 32 // OCT
# Taken where every consumer warp gets a group of four tokens (bench/NOTES.md "The owner epilogue"): with 12 owned
# tokens (TP8, 6 tiles, S = 4) a warp idles and the one-pair-a-lane epilogue measured 0.8% faster. The 5-tile builds
# (20 or 40 owned: five or ten groups, a warp idles in the last round) take it too, not timed against the other.
OCTET_MIN_OWNED = CONSUMER_WARPS * TOKENS_A_WARP


class FrontOctetEpilogue:
    """`finish_octets`, the owner epilogue of the "wg" builds with 16 owned tokens or more (mixin)."""

    @cute.jit
    def finish_octets(self, recv, cs, slots, y_ptr, kc_ptr, vc_ptr, M, block_size, num_blocks, k_block_stride,
                      v_block_stride, eps, place, warp_idx, lane, is_qk, is_k, is_v, kv_head, kv_scale):
        """Every group's math first (padded tokens too: their partials are the zero-filled x rows; nothing of them is
        stored), then the stores: the groups' loads and shuffle rounds overlap."""
        q = lane % OCT
        f32x4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        bf16x8 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        rq = cute.make_tensor(recv.iterator, cute.make_layout((self.k_split * self.owned * HEAD_COLS // QUAD, QUAD),
                                                              stride=(QUAD, 1)))
        csq = cute.make_tensor(cs.iterator, cute.make_layout((self.owned * HEAD_COLS // QUAD, QUAD), stride=(QUAD, 1)))
        groups = self.owned // TOKENS_A_WARP
        rounds = (groups + CONSUMER_WARPS - 1) // CONSUMER_WARPS
        vals = []
        for r in cutlass.range_constexpr(rounds):
            j = (r * CONSUMER_WARPS + warp_idx) * TOKENS_A_WARP + lane // OCT
            jc = cutlass.min(j, self.owned - 1)  # a warp past the last group reads the last token, stores nothing
            x = [Float32(0.0)] * OCT
            for src in cutlass.range_constexpr(self.k_split):  # fixed rank order: deterministic
                for h in cutlass.range_constexpr(OCT // QUAD):
                    f = cute.make_rmem_tensor(cute.make_layout(QUAD), Float32)
                    cute.copy(f32x4, rq[((src * self.owned + jc) * HEAD_COLS + OCT * q) // QUAD + h, None], f)
                    for i in cutlass.range_constexpr(QUAD):
                        x[QUAD * h + i] = x[QUAD * h + i] + f[i]
            cq = cute.make_rmem_tensor(cute.make_layout(QUAD), Float32)
            sq = cute.make_rmem_tensor(cute.make_layout(QUAD), Float32)
            cute.copy(f32x4, csq[jc * (HEAD_COLS // QUAD) + q, None], cq)  # cos of pairs 4q .. 4q + 3
            cute.copy(f32x4, csq[jc * (HEAD_COLS // QUAD) + HEAD_COLS // (2 * QUAD) + q, None], sq)  # their sin
            vals.append((j, [Float32(BFloat16(v)) for v in x], cq, sq))  # the GEMM result is bf16
        outs = []
        for r in cutlass.range_constexpr(rounds):
            j, x, cq, sq = vals[r]
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(OCT):
                ss = ss + x[i] * x[i]
            outs.append(ss)
        for k in cutlass.range_constexpr(3):  # the token's 8 lanes: offsets 1, 2, 4
            for r in cutlass.range_constexpr(rounds):
                outs[r] = outs[r] + cute.arch.shuffle_sync_bfly(outs[r], offset=1 << k)
        mY = cute.make_tensor(y_ptr, cute.make_layout((self.tt, self.n // OCT, OCT), stride=(self.n, OCT, 1)))
        rows = block_size * self.nkv * (HEAD_COLS // OCT)  # 16-byte vectors of one cache block
        mK = cute.make_tensor(kc_ptr, cute.make_layout((num_blocks, rows, OCT),
                                                       stride=(cute.assume(k_block_stride, divby=OCT), OCT, 1)))
        mV = cute.make_tensor(vc_ptr, cute.make_layout((num_blocks, rows, OCT),
                                                       stride=(cute.assume(v_block_stride, divby=OCT), OCT, 1)))
        limit = Int64(num_blocks) * Int64(block_size)
        for r in cutlass.range_constexpr(rounds):
            j, x, cq, sq = vals[r]
            rs = cute.math.rsqrt(outs[r] * Float32(1.0 / HEAD_COLS) + eps)
            o = cute.make_rmem_tensor(cute.make_layout(OCT), BFloat16)
            for i in cutlass.range_constexpr(OCT // 2):  # RoPE pair 4q + i: (a, b) -> (a c - b s, a s + b c)
                an = x[2 * i] * rs
                bn = x[2 * i + 1] * rs
                o[2 * i] = BFloat16(cutlass.select_(is_qk, an * cq[i] - bn * sq[i], x[2 * i]))
                o[2 * i + 1] = BFloat16(cutlass.select_(is_qk, an * sq[i] + bn * cq[i], x[2 * i + 1]))
            t = j * self.k_split + place.rank
            if j < self.owned and t < M:
                cute.copy(bf16x8, o, mY[t, place.head * (HEAD_COLS // OCT) + q, None])
                slot = slots[j]
                if (is_k or is_v) and slot >= Int64(0) and slot < limit:
                    # caches of < 2^31 slots (all real ones) divide in 32 bits, with the same result
                    blk = Int64(0)
                    if limit <= Int64(0x7FFFFFFF):
                        blk = Int64(Int32(slot) // block_size)
                    else:
                        blk = slot // Int64(block_size)
                    vec = (slot - blk * Int64(block_size)) * Int64(self.nkv * (HEAD_COLS // OCT)) \
                        + Int64(kv_head * (HEAD_COLS // OCT) + q)
                    if cutlass.const_expr(self.fp8):  # 8 e4m3 bytes of o / kv_scale (fp8.py)
                        addr = mV[blk, vec, None].iterator.toint()
                        if is_k:
                            addr = mK[blk, vec, None].iterator.toint()
                        _fp8.store_octet(addr, o, kv_scale)
                    elif is_k:
                        cute.copy(bf16x8, o, mK[blk, vec, None])
                    else:
                        cute.copy(bf16x8, o, mV[blk, vec, None])
