"""qkv_front measurements for one (N, M): chain, after-norm, isolated, and the cuBLAS / unfused baselines.

Every mode is a list of launch closures over LAYERS distinct weights (well above the L2), handed to the
same `timing.Graph`; the modes differ only in which closures they list:

- chain:      front_j with PDL                          (x shared, out_j per layer)
- after-norm: pred_j (RMSNorm res_j -> x_j, PDL), front_j on x_j with PDL; `pred-only` = the pred_j
              alone: the front's added time is (after-norm - pred-only) per layer
- isolated:   front_j without the PDL attribute
- cublas:     torch.mm(x, W_j^T)                        unfused: torch.mm + the torch epilogue

The fronts go through the product path: get_kernel(variant) + launch_args(...) + LoadedKernel.launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from musekern.reference import rope_cos_sin_table

from . import report
from .timing import Graph, loops_for, time_graphs
from .unfused import unfused_front

LAYERS = 8
HEAD_DIM = 64
NUM_BLOCKS, BLOCK_SIZE = 256, 16
MAX_POS = 4096


@dataclass
class Shard:
    """One N of the model plan and its LAYERS weights (allocated once per N, reused for every M)."""
    tp: int
    n: int
    num_kv_heads: int
    eps: float
    theta: float
    weights: list = field(default_factory=list)

    def allocate(self, seed: int = 0) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.weights = [(torch.randn(self.n, report.HIDDEN, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
                        for _ in range(LAYERS)]

    def free(self) -> None:
        self.weights = []


@dataclass
class Problem:
    """The decode inputs of one M (random, never zeros: zeros would hide unwritten outputs)."""
    m: int
    x: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slots: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    residuals: list  # the predecessor's inputs, one per layer
    gamma: torch.Tensor
    xs: list  # the predecessor's outputs = the after-norm fronts' x, one per layer
    outs: dict  # mode -> [LAYERS, M, N] bf16


def make_problem(shard: Shard, m: int, modes, seed: int = 1) -> Problem:
    g = torch.Generator(device="cuda").manual_seed(seed + 1000 * m)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(m, report.HIDDEN, device=dev, generator=g).to(bf)
    shape = (NUM_BLOCKS, BLOCK_SIZE, shard.num_kv_heads, HEAD_DIM)
    kv = torch.randn((2, *shape), device=dev, generator=g).to(bf)  # vLLM's split layout
    res = [torch.randn(m, report.HIDDEN, device=dev, generator=g).to(bf) for _ in range(LAYERS)]
    gamma = (1.0 + 0.1 * torch.randn(report.HIDDEN, device=dev, generator=g)).to(bf)
    outs = {mode: torch.empty(LAYERS, m, shard.n, dtype=bf, device=dev) for mode in modes}
    return Problem(m, x, torch.randint(0, MAX_POS, (m,), device=dev, generator=g),
                   rope_cos_sin_table(MAX_POS, shard.theta, dev), torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=dev,
                                                                     generator=g)[:m],
                   kv[0], kv[1], res, gamma, [torch.empty_like(r) for r in res], outs)


def chain_inputs(m: int, theta: float, g: torch.Generator) -> tuple:
    """(cos|sin table, positions, x, residuals, gamma, xs) for a bench of LAYERS chained fronts and their after-norm
    form (an RMSNorm of residuals[j] with gamma into xs[j] before layer j), drawn from `g` in this order."""
    bf = torch.bfloat16
    cs = rope_cos_sin_table(MAX_POS, theta, "cuda")
    pos = torch.randint(0, MAX_POS, (m,), device="cuda", generator=g)
    x = torch.randn(m, report.HIDDEN, device="cuda", generator=g).to(bf)
    res = [torch.randn(m, report.HIDDEN, device="cuda", generator=g).to(bf) for _ in range(LAYERS)]
    gamma = (1.0 + 0.1 * torch.randn(report.HIDDEN, device="cuda", generator=g)).to(bf)
    return cs, pos, x, res, gamma, [torch.empty_like(r) for r in res]


# ---------------------------------------------------------------- launch closures
def front_closure(shard: Shard, p: Problem, j: int, x: torch.Tensor, out: torch.Tensor, pdl: bool):
    """One layer's front through the product path (variant, cached kernel, launch_args, launch)."""
    from musekern.kernels.qkv_front.variant import launch_grid
    from musekern.ops import qkv_front as ops
    from musekern.runtime import get_kernel

    dev = torch.cuda.current_device()
    v = ops._variant(shard.n, p.m, shard.num_kv_heads, dev)
    kern, grid = get_kernel(v, device=dev), launch_grid(v)
    args = ops.launch_args(x, shard.weights[j], p.positions, p.cos_sin, p.slots, p.key_cache, p.value_cache,
                           shard.eps, out)
    return lambda: kern.launch(grid, args, pdl=pdl)


def pred_closure(pred, shard: Shard, p: Problem, j: int):
    return lambda: pred.launch(p.residuals[j], p.gamma, p.xs[j], shard.eps, pdl=True)


def sequences(shard: Shard, p: Problem, modes, pred) -> dict[str, list]:
    """name -> the LAYERS-layer list of closures each graph repeats (the only place the modes differ)."""
    L = range(LAYERS)
    seq = {}
    if "chain" in modes:
        seq["chain"] = [front_closure(shard, p, j, p.x, p.outs["chain"][j], True) for j in L]
    if "isolated" in modes:
        seq["isolated"] = [front_closure(shard, p, j, p.x, p.outs["isolated"][j], False) for j in L]
    if "after-norm" in modes:
        seq["after_norm_total"] = [f for j in L for f in (pred_closure(pred, shard, p, j),
                                                           front_closure(shard, p, j, p.xs[j],
                                                                         p.outs["after-norm"][j], True))]
        seq["pred_only"] = [pred_closure(pred, shard, p, j) for j in L]
    ybuf = torch.empty(p.m, shard.n, dtype=torch.bfloat16, device="cuda")
    seq["cublas"] = [(lambda w=w: torch.mm(p.x, w.t(), out=ybuf)) for w in shard.weights]
    seq["unfused"] = [(lambda w=w: unfused_front(p.x, w, p.positions, p.cos_sin, p.slots, p.key_cache,
                                                 p.value_cache, shard.num_kv_heads, shard.eps))
                      for w in shard.weights]
    return seq


# ---------------------------------------------------------------- correctness guard (outside timing)
def eager_front(shard: Shard, p: Problem, j: int, x: torch.Tensor) -> torch.Tensor:
    out = torch.full((p.m, shard.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    front_closure(shard, p, j, x, out, False)()
    return out


def check_outputs(shard: Shard, p: Problem, graphs: dict, eps: float) -> dict:
    """Replay each front graph once with poisoned outputs; every layer's out must equal an eager, non-PDL
    front on the x that graph used (bitwise: the result depends on the launch shape only). For after-norm
    that x is what the PDL predecessor wrote, so a front that read x before its wait would fail here;
    the predecessor's x is also checked against a torch RMSNorm (within one bf16 ulp)."""
    from .pred import rmsnorm_reference

    res = {}
    for mode, key in (("chain", "chain"), ("isolated", "isolated"), ("after-norm", "after_norm_total")):
        if key not in graphs:
            continue
        outs = p.outs[mode]
        outs.fill_(float("nan"))
        if mode == "after-norm":
            for xj in p.xs:
                xj.fill_(float("nan"))
        graphs[key].replay()
        torch.cuda.synchronize()
        bad = []
        for j in range(LAYERS):
            x = p.xs[j].clone() if mode == "after-norm" else p.x
            if not torch.equal(outs[j], eager_front(shard, p, j, x)):
                bad.append(j)
        r = {"ok": not bad, "bad_layers": bad}
        if mode == "after-norm":
            ref = torch.stack([rmsnorm_reference(p.residuals[j], p.gamma, eps) for j in range(LAYERS)]).float()
            got = torch.stack(p.xs).float()
            err = ((got - ref).abs() - 2.0 ** -7 * ref.abs() - 1e-6).nan_to_num(nan=1.0)
            r["pred_x_ok"] = bool((err <= 0).all().item())
            r["ok"] = r["ok"] and r["pred_x_ok"]
        res[mode] = r
    return res


# ---------------------------------------------------------------- one (N, M)
def measure_pair(shard: Shard, m: int, modes, pred, copy_tbps: float, samples: int) -> dict:
    """Build every graph of this (N, M), check the fronts' outputs, time all graphs round robin."""
    pair = {"N": shard.n, "M": m, "tp": shard.tp, "num_kv_heads": shard.num_kv_heads, "us": {}}
    p = make_problem(shard, m, [md for md in modes if md in report.FRONT_MODES])
    seq = sequences(shard, p, modes, pred)
    loops = loops_for(LAYERS * report.floor_us(shard.n, copy_tbps) * 1e-6)
    graphs = {name: Graph(name, closures, loops, LAYERS) for name, closures in seq.items()}
    pair["output_checks"] = check_outputs(shard, p, graphs, shard.eps)
    timed = time_graphs(list(graphs.values()), samples)
    pair["us"] = {name: t["us"] for name, t in timed.items()}
    pair["samples"] = {name: t["samples"] for name, t in timed.items()}
    pair["loops"] = loops
    pair["graph_edges"] = {name: t["edges"] for name, t in timed.items()}
    bad = [md for md, r in pair["output_checks"].items() if not r["ok"]]
    if bad:
        pair["error"] = f"output check failed: {bad}"
    del graphs, seq, p
    return pair
