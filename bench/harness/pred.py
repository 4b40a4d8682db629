"""The PDL predecessor of the after-norm mode: a decoder layer's input RMSNorm, built at bench time.

res [M, 8192] bf16 (a layer's residual) -> x [M, 8192] bf16 = bf16(res * rsqrt(mean(res^2) + eps) * gamma).
Like the PDL probe's `pred_trig`, it executes griddepcontrol.launch_dependents at its start (the front
may launch and stream weights at once) and griddepcontrol.wait before its first global read (so it
can itself follow a front in the chain and still see completed memory). One CTA per row, 256 threads,
4 x 16-byte vectors per thread. No header is included, so NVRTC needs no include path.

Compiled with NVRTC through cuda.bindings (sm_90a cubin), else `nvcc -cubin`; loaded with
cuModuleLoadData; launched with cuLaunchKernelEx (+ the programmatic-stream-serialization attribute).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

HIDDEN = 8192
THREADS = 256
SYMBOL = "pred_rmsnorm"

SOURCE = r"""
__device__ __forceinline__ float bf2f(unsigned int h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ unsigned int f2bf(float f) {            // round to nearest even (finite inputs)
    unsigned int u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float sumsq2(unsigned int w) {
    float a = bf2f(w & 0xffffu), b = bf2f(w >> 16);
    return a * a + b * b;
}
__device__ __forceinline__ unsigned int norm2(unsigned int w, unsigned int g, float r) {
    float a = bf2f(w & 0xffffu) * r * bf2f(g & 0xffffu);
    float b = bf2f(w >> 16) * r * bf2f(g >> 16);
    return f2bf(a) | (f2bf(b) << 16);
}

extern "C" __global__ void __launch_bounds__(256) pred_rmsnorm(const uint4* __restrict__ res,
                                                               const uint4* __restrict__ gamma,
                                                               uint4* __restrict__ x, float eps) {
    // the dependent front may launch now and stream its weights while this kernel runs
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // everything before this kernel in the stream (e.g. the previous front) is complete and visible
    asm volatile("griddepcontrol.wait;" ::: "memory");
    __shared__ float part[8];
    const int t = threadIdx.x;
    const size_t row = (size_t)blockIdx.x * (8192 / 8);   // 1024 uint4 per row
    uint4 v[4];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = res[row + i * 256 + t];
        ss += sumsq2(v[i].x) + sumsq2(v[i].y) + sumsq2(v[i].z) + sumsq2(v[i].w);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((t & 31) == 0) part[t >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) tot += part[w];
    const float r = rsqrtf(tot * (1.0f / 8192.0f) + eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 g = gamma[i * 256 + t];
        uint4 o;
        o.x = norm2(v[i].x, g.x, r); o.y = norm2(v[i].y, g.y, r);
        o.z = norm2(v[i].z, g.z, r); o.w = norm2(v[i].w, g.w, r);
        x[row + i * 256 + t] = o;
    }
}
"""


# The launch floor: a kernel that does nothing, launched like every other kernel of the bench (graph replay),
# against which a latency-bound kernel (qk_norm at M = 16) is read.
EMPTY_SYMBOL = "empty_kernel"
EMPTY_SOURCE = 'extern "C" __global__ void empty_kernel() {}\n'


def _nvrtc_cubin(arch: str, source: str = SOURCE, name: str = "pred_rmsnorm.cu") -> bytes:
    from cuda.bindings import nvrtc

    def ok(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {err!r}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    prog = ok(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            raise RuntimeError(f"nvrtcCompileProgram: {res[0]!r}: {buf.decode(errors='replace')}")
        size = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        buf = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return bytes(buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvcc_cubin(arch: str, source: str = SOURCE) -> bytes:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        raise RuntimeError("nvcc not found")
    num = arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "pred.cu"), os.path.join(d, "pred.cubin")
        with open(src, "w") as f:
            f.write(source)
        subprocess.run([nvcc, "-cubin", f"-gencode=arch=compute_{num},code={arch}", "-o", out, src], check=True,
                       capture_output=True, text=True, timeout=120)
        with open(out, "rb") as f:
            return f.read()


def compile_cubin(arch: str = "sm_90a", source: str = SOURCE, name: str = "pred_rmsnorm.cu") -> tuple[bytes, str]:
    """(cubin, how): NVRTC first, `nvcc -cubin` if NVRTC is missing or fails (the error of both if neither)."""
    try:
        return _nvrtc_cubin(arch, source, name), "nvrtc"
    except Exception as e1:
        try:
            return _nvcc_cubin(arch, source), f"nvcc (nvrtc failed: {str(e1)[:200]})"
        except Exception as e2:
            detail = getattr(e2, "stderr", "") or ""
            raise RuntimeError(f"cannot build {name}: nvrtc: {e1}; nvcc: {e2} {detail}") from None


class _BuiltKernel:
    """A bench kernel compiled here from CUDA C (compile_cubin), loaded, with its launch configs cached."""

    def __init__(self, arch: str, source: str, name: str, symbol: str):
        from cuda.bindings import driver as drv

        from musekern.runtime.driver import check, launch_config

        self._drv, self._check, self._launch_config = drv, check, launch_config
        cubin, self.built_with = compile_cubin(arch, source, name)
        self.module = check(drv.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        self.func = check(drv.cuModuleGetFunction(self.module, symbol.encode()), f"cuModuleGetFunction({symbol})")
        self._configs: dict = {}

    def _config(self, grid: tuple, block: tuple, stream: int, pdl: bool):
        key = (grid, block, stream, pdl)
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = self._configs[key] = self._launch_config(grid, block, 0, stream, pdl=pdl)
        return cfg

    def _launch(self, grid: tuple, block: tuple, vals: list, pdl: bool, what: str) -> None:
        """cuLaunchKernelEx on torch's current stream; vals: the parameters as ctypes values, in order."""
        import torch

        cfg = self._config(grid, block, torch.cuda.current_stream().cuda_stream, pdl)
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals]) if vals else None
        self._check(self._drv.cuLaunchKernelEx(cfg, self.func, ctypes.addressof(ptrs) if vals else 0, 0), what)


class PredKernel(_BuiltKernel):
    """The loaded predecessor; launch() puts one RMSNorm of M rows on torch's current stream."""

    def __init__(self, arch: str = "sm_90a"):
        super().__init__(arch, SOURCE, "pred_rmsnorm.cu", SYMBOL)

    def launch(self, res, gamma, x, eps: float, pdl: bool = True) -> None:
        """x = RMSNorm(res) * gamma; res, x: contiguous bf16 [M, 8192], gamma bf16 [8192], 16-byte aligned."""
        m = res.shape[0]
        assert res.shape == x.shape == (m, HIDDEN) and gamma.shape == (HIDDEN,)
        self._launch((m, 1, 1), (THREADS, 1, 1), self.params(res, gamma, x, eps), pdl, "cuLaunchKernelEx(pred)")

    @staticmethod
    def params(res, gamma, x, eps: float) -> list:
        """The kernel's parameters as ctypes values (a variant of the source may append its own)."""
        return [ctypes.c_uint64(res.data_ptr()), ctypes.c_uint64(gamma.data_ptr()), ctypes.c_uint64(x.data_ptr()),
                ctypes.c_float(eps)]


class EmptyKernel(_BuiltKernel):
    """The launch floor: `launch()` puts one empty 1-CTA, 32-thread kernel on torch's current stream (no PDL)."""

    def __init__(self, arch: str = "sm_90a"):
        super().__init__(arch, EMPTY_SOURCE, "empty_kernel.cu", EMPTY_SYMBOL)

    def launch(self) -> None:
        self._launch((1, 1, 1), (32, 1, 1), [], False, "cuLaunchKernelEx(empty)")


def rmsnorm_reference(res, gamma, eps: float):
    """What the predecessor computes, in torch (fp32 math, one rounding): its correctness check."""
    import torch

    r = res.float()
    return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(torch.bfloat16)
