"""Test helpers of the ops in an engine, shared by the CPU tests (tests/test_ops_library.py,
tests/test_example_decode_attention.py) and the GPU tests (tests/test_gpu_engine.py): `Ops`, a compiled layer's use
of the ops, and a multi-request serving run for the decoder attention block of examples/decode_attention.py.

`Scheduler` plays the engine: requests join with a prompt (prefilled in the step they join, beside the others'
decode tokens), decode one token a step, leave; blocks come from a shuffled free list and go back to it, so a
request gets blocks another one wrote; some steps are padded to a graph bucket with slot -1 tokens.
`DenseFloat32Block` is the oracle: the same math in float32 with its own dense per-request K/V (it never reads
a paged cache), written from the block's conventions, not from musekern's code.
"""
from __future__ import annotations

import importlib.util
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HEAD = 64
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)  # CUDA-graph batch sizes an engine would pad to
SENTINEL = 64.0  # exact in bf16; a cache row that still holds it was never written, and reading it is far off
EPS = 1e-5


def load_example():
    """examples/decode_attention.py as a module (examples/ is not a package)."""
    name = "decode_attention_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "decode_attention.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


cache_views = load_example().cache_views  # (key_cache, value_cache) of the one kv tensor, in a layout


class Ops(torch.nn.Module):
    """The ops as an engine's compiled layer calls them: the caches are views of one graph input (`kv`)."""

    def __init__(self, layout: str = "vllm"):
        super().__init__()
        self.layout = layout

    def forward(self, x, weight, positions, cos_sin_cache, slot_mapping, kv):
        kc, vc = cache_views(kv, self.layout)
        y = torch.ops.musekern.qkv_front(x, weight, positions, cos_sin_cache, slot_mapping, kc, vc, kc.shape[2], EPS)
        return y, torch.ops.musekern.qk_norm(y[:, :1024], 64, EPS, 0.125)


def module_args(c: dict, kv=None) -> tuple:
    """`Ops`' arguments from a case dict (x, weight, positions, cos_sin_cache, slot_mapping, kv)."""
    return (c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"],
            c["kv"] if kv is None else kv)


def front_args(c: dict, kv=None) -> tuple:
    """musekern::qkv_front's arguments from a case dict (c["layout"] says how kv holds the two caches)."""
    kc, vc = cache_views(c["kv"] if kv is None else kv, c["layout"])
    return (c["x"], c["weight"], c["positions"], c["cos_sin_cache"], c["slot_mapping"], kc, vc, c["num_kv_heads"],
            EPS)


def same(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@dataclass
class Step:
    hidden: torch.Tensor  # [M, hidden] bf16 (padding rows included)
    positions: torch.Tensor  # [M] int64
    slot_mapping: torch.Tensor  # [M] int64, -1 for padding
    block_tables: torch.Tensor  # [R, max_blocks] int64, -1 past each request's blocks
    token_request: torch.Tensor  # [M] int64: row of block_tables
    chunks: list  # (request id, first token row, tokens, first position) of the real tokens
    real: int  # real tokens; rows real.. are padding

    @property
    def m(self) -> int:
        return self.hidden.shape[0]

    def inputs(self, device) -> tuple:
        return tuple(t.to(device) for t in (self.hidden, self.positions, self.slot_mapping, self.block_tables,
                                            self.token_request))


@dataclass
class Scheduler:
    num_blocks: int
    block_size: int
    max_blocks: int
    hidden: int = 8192
    seed: int = 0
    lengths: dict = field(default_factory=dict)  # request id -> tokens in the cache
    blocks: dict = field(default_factory=dict)  # request id -> its block ids
    next_id: int = 0

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        # hidden states from a stream apart from random_weights' (same seed: hidden rows would repeat weight rows)
        self.gen = torch.Generator().manual_seed(10_000 + self.seed)
        self.free = list(range(self.num_blocks))
        self.rng.shuffle(self.free)

    def _slot(self, rid: int, pos: int) -> int:
        blocks = self.blocks[rid]
        while len(blocks) <= pos // self.block_size:
            if len(blocks) == self.max_blocks:
                raise ValueError(f"request {rid} outgrew {self.max_blocks} blocks")
            blocks.append(self.free.pop())
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def leave(self, rid: int) -> None:
        self.free += self.blocks.pop(rid)
        del self.lengths[rid]
        self.rng.shuffle(self.free)

    def step(self, joins=(), leaves=(), pad: bool = False) -> Step:
        """One engine step: `leaves` go, every remaining request decodes one token, `joins` (prompt lengths)
        join and prefill their prompt."""
        for rid in leaves:
            self.leave(rid)
        work = [(rid, 1) for rid in sorted(self.lengths)]
        for n in joins:
            rid, self.next_id = self.next_id, self.next_id + 1
            self.lengths[rid], self.blocks[rid] = 0, []
            work.append((rid, n))
        positions, slots, token_req, chunks, rows = [], [], [], [], []
        for r, (rid, n) in enumerate(work):
            start = self.lengths[rid]
            chunks.append((rid, len(positions), n, start))
            for p in range(start, start + n):
                positions.append(p)
                slots.append(self._slot(rid, p))
                token_req.append(r)
            self.lengths[rid] = start + n
            rows.append(self.blocks[rid] + [-1] * (self.max_blocks - len(self.blocks[rid])))
        real = len(positions)
        m = next(b for b in BUCKETS if b >= real) if pad else real
        positions += [0] * (m - real)
        slots += [-1] * (m - real)
        token_req += [0] * (m - real)
        hidden = torch.randn(m, self.hidden, generator=self.gen).to(torch.bfloat16)
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return Step(hidden, i64(positions), i64(slots), i64(rows), i64(token_req), chunks, real)

    def active(self) -> list:
        return sorted(self.lengths)


def run_schedule(sched: Scheduler, prompts, decode_sizes, pad_every: int = 3):
    """The steps of a run: one prefill step of `prompts`, then a decode step per entry of `decode_sizes` (the
    number of requests after it: fewer means random requests leave first, more means new requests join with
    prompts of 1..24 tokens). Every `pad_every`-th step is padded to a bucket. Yields (Step, left ids)."""
    yield sched.step(joins=prompts, pad=True), []
    for i, size in enumerate(decode_sizes):
        active = sched.active()
        leaves = sched.rng.sample(active, max(0, len(active) - size))
        joins = [sched.rng.randint(1, 24) for _ in range(max(0, size - len(active)))]
        yield sched.step(joins=joins, leaves=leaves, pad=(i % pad_every == 1)), leaves


class DenseFloat32Block:
    """The decoder attention block in float32, with dense per-request K/V (the oracle)."""

    def __init__(self, weights, num_q_heads: int, num_kv_heads: int, cos_sin_cache: torch.Tensor, qk_eps: float,
                 rms_eps: float):
        self.norm, self.qkv, self.o = (t.float() for t in (weights.norm, weights.qkv, weights.o))
        self.nq, self.nkv = num_q_heads, num_kv_heads
        self.cs = cos_sin_cache.float()
        self.qk_eps, self.rms_eps = qk_eps, rms_eps
        self.k, self.v = {}, {}

    def leave(self, rid: int) -> None:
        del self.k[rid], self.v[rid]

    def _rope(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Unweighted RMS norm over each 64-wide head, then RoPE on pairs (2i, 2i+1) with angle i of the position."""
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.qk_eps)
        c = self.cs[pos][:, None, : HEAD // 2]
        s = self.cs[pos][:, None, HEAD // 2:]
        even, odd = h[..., 0::2], h[..., 1::2]
        out = torch.empty_like(h)
        out[..., 0::2] = even * c - odd * s
        out[..., 1::2] = even * s + odd * c
        return out

    def step(self, st: Step, device) -> torch.Tensor:
        """The outputs [real, hidden] of the step's real tokens, in float32."""
        x = st.hidden[:st.real].to(device).float()
        pos = st.positions[:st.real].to(device)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.rms_eps) * self.norm
        heads = (x @ self.qkv.t()).view(st.real, -1, HEAD)
        nq, nkv = self.nq, self.nkv
        q = self._rope(heads[:, :nq], pos)
        k = self._rope(heads[:, nq:nq + nkv], pos)
        v, gate = heads[:, nq + nkv:nq + 2 * nkv], heads[:, nq + 2 * nkv:]
        attn = torch.empty_like(q)
        group = nq // nkv
        for rid, row, n, start in st.chunks:
            assert self.k.get(rid, torch.empty(0)).shape[0] == start
            self.k[rid] = torch.cat([self.k[rid], k[row:row + n]]) if start else k[row:row + n].clone()
            self.v[rid] = torch.cat([self.v[rid], v[row:row + n]]) if start else v[row:row + n].clone()
            kk = self.k[rid].repeat_interleave(group, dim=1).transpose(0, 1)  # [nq, L, 64]
            vv = self.v[rid].repeat_interleave(group, dim=1).transpose(0, 1)
            s = q[row:row + n].transpose(0, 1) @ kk.transpose(1, 2) / math.sqrt(HEAD)  # [nq, n, L]
            key_pos = torch.arange(start + n, device=device)
            causal = key_pos[None, :] <= key_pos[start:, None]  # token i of the chunk is at position start + i
            s = s.masked_fill(~causal, float("-inf"))
            attn[row:row + n] = (torch.softmax(s, -1) @ vv).transpose(0, 1)
        gated = attn * torch.sigmoid(gate)
        return gated.reshape(st.real, nq * HEAD) @ self.o.t()


def untouched_ok(before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor, layout: str) -> bool:
    """Every cache row outside the step's valid slots is bit for bit what it was."""
    kb, vb = cache_views(before, layout)
    ka, va = cache_views(after, layout)
    nb, bs = kb.shape[0], kb.shape[1]
    keep = torch.ones(nb * bs, dtype=torch.bool, device=before.device)
    valid = slots[(slots >= 0) & (slots < nb * bs)].to(before.device)
    keep[valid] = False
    flat = lambda t: t.reshape(nb * bs, -1)[keep]  # noqa: E731
    return torch.equal(flat(kb), flat(ka)) and torch.equal(flat(vb), flat(va))


def bf16_bound(torch_err: float, scale: float) -> float:
    """The block's error bound: 2x the error of the same block with torch's own bf16 front (the house rule for a
    kernel, applied to everything after it) plus one bf16 rounding at the output's scale (2^-8 relative)."""
    return 2 * torch_err + 2.0 ** -8 * scale


def serve(device, layout: str, prompts, decode_sizes, *, num_blocks: int, block_size: int, max_blocks: int,
          tp: int = 8, seed: int = 0, on_step=None) -> list:
    """Run the schedule through the musekern block, the same block with torch's bf16 front
    (musekern.reference.qkv_front_reference) and the float32 oracle; one record per step.

    The musekern block's caches start poisoned with SENTINEL, so a read of a row the front did not write
    shows; `on_step(step, call)` may wrap the musekern block's call (`call()` returns its output)."""
    from musekern.config import load_config
    from musekern.reference import qkv_front_reference

    ex = load_example()
    cfg = load_config()
    shard = cfg.shard(tp)
    w = ex.random_weights(shard, cfg.hidden_size, seed, device)
    kw = dict(num_blocks=num_blocks, block_size=block_size, layout=layout, max_pos=4096, rope_theta=cfg.rope_theta,
              qk_eps=cfg.rms_norm_eps, rms_eps=cfg.rms_norm_eps)
    block = ex.DecoderAttentionBlock(w, shard, **kw)
    torch_block = ex.DecoderAttentionBlock(w, shard, front=qkv_front_reference, **kw)
    block.kv.fill_(SENTINEL)
    dense = DenseFloat32Block(w, shard.num_q_heads, shard.num_kv_heads, block.cos_sin_cache, cfg.rms_norm_eps,
                              cfg.rms_norm_eps)
    sched = Scheduler(num_blocks, block_size, max_blocks, cfg.hidden_size, seed)
    records = []
    for st, left in run_schedule(sched, prompts, decode_sizes):
        for rid in left:
            dense.leave(rid)
        args = st.inputs(device)
        before = block.kv.clone()
        call = lambda a=args: block(*a)  # noqa: E731
        out = on_step(st, call) if on_step else call()
        ref = torch_block(*args)
        want = dense.step(st, device)
        got, ref = out[:st.real].float(), ref[:st.real].float()
        err, torch_err = (got - want).abs().max().item(), (ref - want).abs().max().item()
        scale = want.abs().max().item()
        records.append({"m": st.m, "real": st.real, "requests": len(st.chunks),
                        "prefill_tokens": sum(n for _, _, n, _ in st.chunks if n > 1),
                        "err": err, "torch_err": torch_err, "scale": scale, "bound": bf16_bound(torch_err, scale),
                        "finite": bool(torch.isfinite(out).all()),
                        "untouched_ok": untouched_ok(before, block.kv, st.slot_mapping, layout)})
    return records
