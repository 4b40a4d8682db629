"""torch's 1x128 block-scaled `_scaled_mm` faults in CUDA-graph replay ("an illegal memory access"; H100, torch
2.11.0+cu130; bench/NOTES.md "e4m3 weights"): the same sequence as `gemm_forms.py --only block4,block8,block16
--locate`, in torch alone, for a report upstream.

Per M: 8 layers of e4m3 weights [N, 8192] with 1x128 weight scales [64, N] (the [N, 64] column-major form torch
takes), x quantized [rows, 8192] with scales [rows, 64] column-major, for rows = M padded to 4, 8 and 16; one graph
per padding holding `--loops` passes over the 8 layers (each graph warmed up on a side stream, then captured on
torch's default capture stream), each graph replayed alone and synchronized, then `--replays` round-robin replays.
Then the tensors are dropped and torch.cuda.empty_cache() runs (`--keep-cache`: not). Prints one line an M; the first
error stops the run and names the M and the graph (exit 1). `--slack` on this sequence (the one that faults): a fault
that stops is a read past the end of a tensor that lands in unmapped memory only after a teardown (round 87's 0 faults
with slack ran one graph an M, which does not fault anyway). `--eager`: each call once, no graph, for
`PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck` (every tensor its own cudaMalloc, so memcheck sees
a read past any tensor: under the caching allocator a read inside the same segment is invisible to it).

python3 bench/probes/torch_block_mm_fault.py [--n 2176] [--ms 33,36,...] [--loops 16] [--pads 4,8,16]
    [--slack BYTES --on w,sw,q,sx,y] [--keep-cache] [--eager]
"""
from __future__ import annotations

import argparse
import sys

import torch

K, LAYERS = 8192, 8


def block_mm(q, w, sx, sw, y):
    return torch._scaled_mm(q, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, out=y)


def padded(t: torch.Tensor, slack: int, on: bool) -> torch.Tensor:
    """t itself, or (on) a copy at the start of an allocation `slack` bytes longer (reads past t's end land in it)."""
    if not on or not slack:
        return t
    buf = torch.zeros(t.numel() * t.element_size() + slack, dtype=torch.uint8, device=t.device)
    return buf[:t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)


def graphs_for(n: int, m: int, pads, loops: int, g: torch.Generator, slack: int = 0, on=(), eager: bool = False):
    w = [padded(torch.randn(n, K, device="cuda", generator=g).div_(K ** 0.5).to(torch.float8_e4m3fn), slack, "w" in on)
         for _ in range(LAYERS)]
    sw = [padded(torch.rand(K // 128, n, device="cuda", generator=g) + 0.5, slack, "sw" in on) for _ in range(LAYERS)]
    xq = torch.randn(m, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    out = []
    for pad in pads:
        rows = -(-m // pad) * pad
        q = padded(torch.cat([xq, torch.zeros(rows - m, K, dtype=xq.dtype, device="cuda")]), slack, "q" in on)
        sx = padded(torch.ones(K // 128, rows, device="cuda"), slack, "sx" in on).t()
        y = [padded(torch.empty(rows, n, dtype=torch.bfloat16, device="cuda"), slack, "y" in on) for _ in range(LAYERS)]
        calls = [(lambda j=j, q=q, sx=sx, y=y: block_mm(q, w[j], sx, sw[j], y[j])) for j in range(LAYERS)]
        if eager:
            for f in calls:
                f()
            torch.cuda.synchronize()
            continue
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in calls:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(loops):
                for f in calls:
                    f()
        out.append((f"pad{pad}", gr))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2176, help="N (2176: the TP8 shard of bench/probes/gemm_forms.py)")
    ap.add_argument("--ms", default="33,36,40,44,48,52,56,60,64,72,96,100,128,256")
    ap.add_argument("--pads", default="4,8,16")
    ap.add_argument("--loops", type=int, default=16, help="passes over the 8 layers a graph holds")
    ap.add_argument("--replays", type=int, default=12)
    ap.add_argument("--keep-cache", action="store_true")
    ap.add_argument("--slack", type=int, default=0, help="bytes allocated past the end of each tensor in --on")
    ap.add_argument("--on", default="w,sw,q,sx,y", help="the tensors --slack pads")
    ap.add_argument("--eager", action="store_true", help="each call once, no graph (memcheck, no caching allocator)")
    a = ap.parse_args()
    print(f"torch {torch.__version__} CUDA {torch.version.cuda} {torch.cuda.get_device_name()} N={a.n}"
          f"{f' slack {a.slack} on {a.on}' if a.slack else ''}{' eager' if a.eager else ''}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    pads = [int(p) for p in a.pads.split(",")]
    for m in (int(s) for s in a.ms.split(",")):
        where = "eager call" if a.eager else "capture"
        try:
            graphs = graphs_for(a.n, m, pads, a.loops, g, a.slack, a.on.split(","), a.eager)
            for name, gr in graphs:
                where = f"replay {name}"
                gr.replay()
                torch.cuda.synchronize()
            where = "round-robin replays"
            for _ in range(a.replays):
                for _, gr in graphs:
                    gr.replay()
            torch.cuda.synchronize()
            del graphs
            if not a.keep_cache:
                torch.cuda.empty_cache()
        except (RuntimeError, torch.AcceleratorError) as e:
            print(f"M={m}: FAULT in {where}: {str(e).splitlines()[0]}", flush=True)
            return 1
        print(f"M={m}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
