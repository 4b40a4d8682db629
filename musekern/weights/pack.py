"""Packing an FP8 checkpoint's q, k, v, gate into the front's canonical device layout, for one tensor-parallel rank
(torch, CPU or GPU; no kernels). Every checkpoint format (formats.py) packs to this one layout:

- `weight`: float8_e4m3fn [N, 8192], contiguous, rows q | k | v | gate of ONE rank, in the bf16 weight's row order
  (reference.qkv_front_reference, config.ShardShape): rank r of tp takes q heads [r*nq/tp, (r+1)*nq/tp), the same
  gate heads, and kv heads [r*nkv/tp, (r+1)*nkv/tp), or where tp > nkv the one kv head r // (tp // nkv) (kv heads
  replicate). A head is 64 rows (model.HEAD_DIM), so every part starts and ends on a 64-row boundary.
- `weight_scale`: float32 dequant MULTIPLIERS (W ~= float(weight) * scale), by granularity:
  - "block": [N // 64, 8192 // 128]: one scale per (64-row group, 128-column K block). Each checkpoint 128x128
    block's scale goes to both of its 64-row halves, so a rank whose k or v part is 64 rows (half a block: TP8 with
    8 KV heads, which vLLM refuses) takes the original block's scale exactly. Every tensor's blocks start at its
    row 0 and every part boundary is 64-aligned, so no 64-row group spans two blocks (asserted).
  - "channel" and "tensor": [N], one per row. A per-tensor checkpoint's q, k, v and gate scales become per-row
    scales of the fused projection: exact (no requantization to the largest scale, as vLLM's
    requantize_with_max_scale does).
  Checkpoint scales stored in bf16, fp16 or fp32 are upcast exactly; ue8m0 scales must be powers of two.

`dequantize(packed)` (`dequantize_tensors(weight, weight_scale)`) is the fp32 weight the kernels are tested
against; `quantize_reference(w, fmt)` makes a synthetic checkpoint tensor pair (tests, benchmarks). Every problem
with the input is a ValueError of one line.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv_cache import E4M3_MAX
from ..model import HEAD_DIM, HIDDEN
from .formats import WeightFormat

GROUP_ROWS = HEAD_DIM  # rows of one block-scale group in the canonical layout: one head
K_BLOCK = 128  # columns of one block-scale group (the checkpoint's block K)
PARTS = ("q", "k", "v", "gate")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PackedWeight:
    """One rank's front weight in the canonical layout (module docstring)."""
    weight: torch.Tensor  # float8_e4m3fn [n, 8192]
    weight_scale: torch.Tensor  # float32: [n // 64, 64] (block) or [n] (channel, tensor)
    fmt: WeightFormat
    n: int


def rank_rows(*, num_q_heads: int, num_kv_heads: int, tp: int, rank: int,
              gate: bool = True) -> dict[str, tuple[int, int]]:
    """part -> the [start, stop) rows of the full (unsharded) checkpoint tensor that rank `rank` of `tp` takes."""
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("tp", tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank!r}")
    if num_q_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_q_heads ({num_q_heads})")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_kv_heads ({num_kv_heads})")
        kv_per, kv0 = num_kv_heads // tp, rank * (num_kv_heads // tp)
    else:
        if tp % num_kv_heads:
            raise ValueError(f"tp={tp} > num_kv_heads ({num_kv_heads}) must be a multiple of it to replicate kv heads")
        kv_per, kv0 = 1, rank // (tp // num_kv_heads)
    nq = num_q_heads // tp
    q = (rank * nq * HEAD_DIM, (rank + 1) * nq * HEAD_DIM)
    kv = (kv0 * HEAD_DIM, (kv0 + kv_per) * HEAD_DIM)
    return {"q": q, "k": kv, "v": kv, **({"gate": q} if gate else {})}


def _full_rows(num_q_heads: int, num_kv_heads: int) -> dict[str, int]:
    return {"q": num_q_heads * HEAD_DIM, "k": num_kv_heads * HEAD_DIM, "v": num_kv_heads * HEAD_DIM,
            "gate": num_q_heads * HEAD_DIM}


def _shape(t) -> list[int]:
    return list(t.shape)


def _weight(part: str, w, rows: int) -> torch.Tensor:
    """The checkpoint weight as float8_e4m3fn [rows, 8192]."""
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{part} weight must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype == torch.uint8:
        w = w.view(torch.float8_e4m3fn)
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{part} weight is {w.dtype}; expected float8_e4m3fn (or uint8 holding e4m3 bytes)")
    if w.dim() != 2 or w.shape[1] != HIDDEN:
        raise ValueError(f"{part} weight has shape {_shape(w)}; expected [{rows}, {HIDDEN}] (K is the model's "
                         f"hidden size, {HIDDEN})")
    if w.shape[0] != rows:
        raise ValueError(f"{part} weight has {w.shape[0]} rows; expected {rows} (its heads x {HEAD_DIM}, unsharded)")
    return w


def _scale(part: str, s, fmt: WeightFormat, rows: int, device) -> torch.Tensor:
    """The checkpoint scale, checked, as float32 on `device`: block [ceil(rows/128), 64], channel [rows],
    tensor [] (0-dim)."""
    if not isinstance(s, torch.Tensor):
        raise ValueError(f"{part} scale must be a torch.Tensor, got {type(s).__name__}")
    if s.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{part} scale is {s.dtype}; expected float32, bfloat16 or float16")
    g = fmt.granularity
    if g == "block":
        bn, bk = fmt.block
        want = [-(-rows // bn), -(-HIDDEN // bk)]
        ok = _shape(s) == want
        expected = f"[{want[0]}, {want[1]}] (one per {bn}x{bk} block)"
    elif g == "channel":
        ok = _shape(s) in ([rows, 1], [rows])
        expected = f"[{rows}, 1] or [{rows}] (one per row)"
    else:
        ok = _shape(s) in ([], [1])
        expected = "[] or [1] (one per tensor)"
    if not ok:
        raise ValueError(f"{part} scale has shape {_shape(s)}; a {fmt.name} checkpoint stores {expected}")
    s = s.to(device=device, dtype=torch.float32)  # exact from bf16 / fp16
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"{part} scale holds NaN or inf")
    if not bool((s > 0).all()):
        raise ValueError(f"{part} scale holds a value <= 0 (min {float(s.min())}); scales are positive multipliers")
    if fmt.ue8m0 and not bool((torch.frexp(s).mantissa == 0.5).all()):
        raise ValueError(f"{part} scale holds a value that is not a power of two; ue8m0 scales are")
    return s.reshape(-1) if g == "channel" else s.reshape(()) if g == "tensor" else s


def _rank_scale(part: str, s: torch.Tensor, fmt: WeightFormat, start: int, stop: int) -> torch.Tensor:
    """The canonical scales of rows [start, stop) of one full tensor's checked scale `s`."""
    if fmt.granularity == "channel":
        return s[start:stop]
    if fmt.granularity == "tensor":
        return s.expand(stop - start)
    bn = fmt.block[0]
    assert start % GROUP_ROWS == 0 and stop % GROUP_ROWS == 0 and bn % GROUP_ROWS == 0, (part, start, stop, bn)
    first = torch.arange(start, stop, GROUP_ROWS, device=s.device)  # each 64-row group's first row in the tensor
    block = torch.div(first, bn, rounding_mode="floor")
    assert torch.equal(block, torch.div(first + GROUP_ROWS - 1, bn, rounding_mode="floor")), part  # one block each
    return s.index_select(0, block)


def pack_rank(fmt: WeightFormat, tensors: dict, *, num_q_heads: int, num_kv_heads: int, tp: int, rank: int,
              gate: bool) -> PackedWeight:
    """Rank `rank` of `tp`'s canonical front weight from a checkpoint's full q, k, v (and gate) tensors.

    `tensors`: part -> (weight, scale) as the checkpoint stores them, unsharded: weight float8_e4m3fn or uint8
    [heads * 64, 8192]; scale float32 / bfloat16 / float16 of the format's shape: block [ceil(rows/128), 64],
    channel [rows, 1] or [rows], tensor [] or [1]. "gate" exactly where `gate` is true. The result lives on q's
    weight's device."""
    if not isinstance(fmt, WeightFormat) or not fmt.fp8:
        raise ValueError(f"pack_rank packs fp8 weights, got {getattr(fmt, 'name', fmt)!r}; a bf16 front's weight is "
                         f"the bf16 tensor as it is")
    rows = rank_rows(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, tp=tp, rank=rank, gate=gate)
    parts = PARTS if gate else PARTS[:3]
    if not isinstance(tensors, dict) or set(tensors) != set(parts):
        got = sorted(map(str, tensors)) if isinstance(tensors, dict) else type(tensors).__name__
        raise ValueError(f"tensors has {got}; expected the parts {', '.join(parts)}")
    full = _full_rows(num_q_heads, num_kv_heads)
    weights, scales, at = [], [], 0
    device = None
    for part in parts:
        pair = tensors[part]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"tensors[{part!r}] must be a (weight, scale) pair")
        w = _weight(part, pair[0], full[part])
        device = w.device if device is None else device
        if w.device != device:
            raise ValueError(f"{part} weight is on {w.device}, q's on {device}: pass one device's tensors")
        s = _scale(part, pair[1], fmt, full[part], device)
        start, stop = rows[part]
        assert at % GROUP_ROWS == 0 and (stop - start) % GROUP_ROWS == 0, (part, at, start, stop)  # 64-row parts
        piece = w[start:stop]
        if bool(((piece.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise ValueError(f"{part} weight holds e4m3 NaN bytes (0x7f / 0xff) in rank {rank}'s rows "
                             f"[{start}, {stop})")
        weights.append(piece)
        scales.append(_rank_scale(part, s, fmt, start, stop))
        at += stop - start
    weight = torch.cat(weights).contiguous()
    scale = torch.cat(scales).contiguous()
    want = [at // GROUP_ROWS, HIDDEN // K_BLOCK] if fmt.granularity == "block" else [at]
    assert _shape(weight) == [at, HIDDEN] and _shape(scale) == want, (_shape(weight), _shape(scale), want)
    return PackedWeight(weight, scale, fmt, at)


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """float32 [N, 8192]: float(weight) * its scale (each product one fp32 rounding of the exact product)."""
    return dequantize_tensors(packed.weight, packed.weight_scale)


def dequantize_tensors(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """`dequantize` of the canonical pair itself (the ops' calls carry no PackedWeight): the scale's rank says the
    granularity, [N // 64, 64] block, [N] per row. Pure torch ops on the tensors' device (no host sync)."""
    n = weight.shape[0]
    w, s = weight.float(), weight_scale.float()
    if s.dim() == 2:
        return (w.reshape(n // GROUP_ROWS, GROUP_ROWS, HIDDEN // K_BLOCK, K_BLOCK)
                * s[:, None, :, None]).reshape(n, HIDDEN)
    return w * s[:, None]


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn of x, rounded to nearest even and saturated to +-448 (clamped first: whether torch's own cast
    saturates or makes NaN of values past 464 has differed between versions and devices). NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_reference(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic checkpoint (weight float8_e4m3fn, scale in fmt.scale_dtype) of the float weight `w` [rows, K]:
    scale = amax / 448 per block (fmt.block, zero-padded at the edges, cut after) / row / tensor (1.0 where amax is
    0), rounded UP to a power of two for ue8m0, then stored in fmt.scale_dtype; weight = to_e4m3(w / stored scale).
    Scale shapes as checkpoints store them: block [ceil(rows/bn), ceil(K/bk)], channel [rows, 1], tensor [1]."""
    if not fmt.fp8:
        raise ValueError(f"quantize_reference makes fp8 checkpoints, got {fmt.name!r}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError("w must be a 2-D floating-point tensor")
    x = w.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("w holds NaN or inf (after the cast to float32)")
    rows, k = x.shape
    if fmt.granularity == "block":
        bn, bk = fmt.block
        rb, kb = -(-rows // bn), -(-k // bk)
        padded = torch.zeros(rb * bn, kb * bk, dtype=torch.float32, device=x.device)
        padded[:rows, :k] = x
        amax = padded.abs().reshape(rb, bn, kb, bk).amax(dim=(1, 3))
    elif fmt.granularity == "channel":
        amax = x.abs().amax(dim=1, keepdim=True)
    else:
        amax = x.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if fmt.ue8m0:
        m, e = torch.frexp(scale)  # scale = m * 2^e, m in [0.5, 1): a power of two stays, anything else goes up
        scale = torch.ldexp(torch.ones_like(scale), torch.where(m == 0.5, e - 1, e))
    stored = scale.to(getattr(torch, fmt.scale_dtype))
    s = stored.float()
    if fmt.granularity == "block":
        full = s.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :k]
    else:
        full = s.reshape(-1, 1) if fmt.granularity == "channel" else s.reshape(())
    return to_e4m3(x / full), stored
