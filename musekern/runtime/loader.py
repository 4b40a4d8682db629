"""The runtime loader: cached cubin -> CUfunction -> cuLaunchKernelEx. No cutlass, no compiler.

Everything it needs comes from the entry's manifest.json: the entry symbol, the ordered
parameter ABI (store/abi.py), the launch configuration (block, cluster, dynamic smem,
PDL) and the tensor-map encode parameters. Kernels are loaded once per process and device.
"""
from __future__ import annotations

import ctypes
import functools
import operator
import struct
import threading

from cuda.bindings import driver as drv

from .. import targets
from ..store import hygiene, lookup
from ..store.abi import KernelAbi, cubin_arch
from ..store.cache import Cache, CacheError, MissingEntryError, default_cache_dir
from ..store.keys import dsl_version, key_parts
from ..store.lookup import Policy
from .driver import c_launch_kernel_ex, check, device_info, ensure_context, launch_config
from .tensormap import TensorMaps

_FIELD_FMT = {"u8": "B", "i32": "i", "u32": "I", "f32": "f", "i64": "q", "u64": "Q"}


class MissingKernelError(LookupError):
    """No cache entry for a variant; the message names it and the command that builds it."""


class ArchMismatchError(RuntimeError):
    pass


def _aligned_buffer(size: int, align: int):
    raw = (ctypes.c_uint8 * (size + align))()
    base = ctypes.addressof(raw) + (-ctypes.addressof(raw)) % align
    return raw, base


class _ParamBlock:
    """All kernel parameters in one host buffer, each at its own aligned offset, filled by one
    struct.pack_into: kernelParams is the array of pointers to the parameters (NOTES.md: the cubin
    places parameters at padded offsets, so an array of pointers, not one packed buffer, is passed).
    One pack call per launch instead of one per parameter keeps the host cost low (issue 5: <= 10 us).
    """

    def __init__(self, params, tensormaps):
        offsets, off = [], 0
        for p in params:
            align = max(p.align, 64 if p.kind == "tensormap" else 8)
            off = (off + align - 1) // align * align
            offsets.append(off)
            off += p.size
        self._raw, self.base = _aligned_buffer(max(off, 8), 64)
        self.view = memoryview((ctypes.c_uint8 * max(off, 8)).from_address(self.base)).cast("B")
        self.pointers = (ctypes.c_void_p * max(len(params), 1))(*[self.base + o for o in offsets])
        tmap_of = {t.param: t for t in tensormaps}
        fmt, pos, self.names, self.tmaps = "<", 0, [], []
        for p, o in zip(params, offsets, strict=True):
            for f in sorted(p.fields, key=lambda f: f.offset):
                fmt += "x" * (o + f.offset - pos)
                if f.type == "bytes":
                    fmt += f"{f.size}s"
                    spec = tmap_of.get(p.name)
                    if spec is not None:  # the value is the tensor; the loader encodes its map
                        self.tmaps.append((len(self.names), spec))
                        self.names.append(spec.tensor)
                        pos = o + f.offset + f.size
                        continue
                else:
                    fmt += _FIELD_FMT[f.type]
                pos = o + f.offset + f.size
                self.names.append(f.name)
        self.struct = struct.Struct(fmt)
        self.getter = operator.itemgetter(*self.names) if len(self.names) > 1 else (
            lambda a, n=self.names: (a[n[0]],) if n else ())

    def values(self, args: dict) -> list:
        return list(self.getter(args))


class LoadedKernel:
    """A cubin loaded on one device, ready to launch with named arguments."""

    def __init__(self, entry, cubin: bytes, device_index: int):
        self.entry = entry
        self.label = entry.manifest.get("label", entry.key)
        self.symbol = entry.manifest["symbol"]
        self.abi = KernelAbi.from_json(entry.manifest["abi"])
        self.device_index = device_index
        ensure_context(device_index)
        lbl = self.label
        self._library = check(drv.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData", lbl)
        kern = check(drv.cuLibraryGetKernel(self._library, self.symbol.encode()), "cuLibraryGetKernel", lbl)
        self.func = check(drv.cuKernelGetFunction(kern), "cuKernelGetFunction", lbl)
        self._set_attributes()
        self._block = _ParamBlock(self.abi.params, self.abi.tensormaps)
        self._kp_addr = ctypes.addressof(self._block.pointers)
        self._maps = [(i, TensorMaps(spec, lbl)) for i, spec in self._block.tmaps]  # per tensor-map parameter
        self._c_launch = c_launch_kernel_ex()
        self._func_addr = int(self.func)
        self._lock = threading.Lock()  # the parameter block is shared: pack + launch (which copies it) are one step
        self._launchers: dict = {}  # (grid, pdl) -> launch_ordered's launcher

    def _set_attributes(self) -> None:
        A, L, lbl = drv.CUfunction_attribute, self.abi.launch, self.label
        info = device_info(self.device_index)
        static = check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.func), "smem query", lbl)
        if static + L.dynamic_smem_bytes > info["smem_optin"]:
            raise RuntimeError(f"{lbl}: needs {static} static + {L.dynamic_smem_bytes} dynamic bytes of shared "
                               f"memory, the device allows {info['smem_optin']}; prepare it for this GPU's target")
        check(drv.cuFuncSetAttribute(self.func, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     L.dynamic_smem_bytes), "cuFuncSetAttribute(max dynamic smem)", lbl)
        csize = L.cluster[0] * L.cluster[1] * L.cluster[2]
        if csize > targets.PORTABLE_MAX_CLUSTER:
            check(drv.cuFuncSetAttribute(self.func, A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                  "cuFuncSetAttribute(non-portable cluster)", lbl)
        self.num_regs = check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, self.func), "regs query", lbl)
        self.static_smem = static

    @property
    def param_names(self) -> tuple:
        """The launch values in ABI order: field names, and for tensor-map parameters the tensor's name."""
        return tuple(self._block.names)

    def launcher(self, grid: tuple, take: tuple | None = None, pdl: bool | None = None):
        """`launch(values, stream=None)`: this kernel on `grid`, on `stream` (a CUstream handle as int; default:
        torch's current stream on the kernel's device).

        `values` is a list: without `take`, in `param_names` order; with it, the values an op computes per call
        in its own order, `take[i]` the index of the i-th of `param_names` among them. A tensor-map value is the
        2-D tensor or (ptr, rows, cols, row_stride_elems); the launch replaces it in `values` by the encoded map.
        Everything a call does not change is bound here, once (the parameter block, the launch configuration of
        each stream, the tensor-map caches): a launch is the stream query, one pack and the driver call (the host
        cost of an eager op, issue 14). `pdl` overrides the manifest's programmatic-stream-serialization
        attribute (False: a plain stream-ordered launch).
        """
        grid = tuple(grid) + (1,) * (3 - len(grid))
        pdl = self.abi.launch.pdl if pdl is None else pdl
        blk, n = self._block, len(self._block.names)
        if take is not None and tuple(take) == tuple(range(n)):
            take = None  # the op's order is the kernel's: no reordering per call
        pick = None if take is None else (operator.itemgetter(*take) if n > 1 else (lambda v, i=take[0]: (v[i],)))
        maps = tuple((i if take is None else take[i], m.maps, m.encode) for i, m in self._maps)
        configs: dict = {}  # stream -> (CUlaunchConfig, a no-argument launch); the config owns its C memory
        c_launch, func, kp, label = self._c_launch, self._func_addr, self._kp_addr, self.label
        acquire, release = self._lock.acquire, self._lock.release
        pack, view, dev, stream_of = blk.struct.pack_into, blk.view, self.device_index, current_stream_getter()

        def config(stream: int):
            cfg = launch_config(grid, self.abi.launch.block, self.abi.launch.dynamic_smem_bytes, stream,
                                self.abi.launch.cluster, pdl)
            if c_launch is not None:
                go = functools.partial(c_launch, cfg.getPtr(), func, kp, None)
            else:
                go = functools.partial(_bindings_launch, cfg, self.func, kp)
            if len(configs) >= 64:
                configs.clear()
            got = configs[stream] = (cfg, go)
            return got

        def launch(values: list, stream: int | None = None) -> None:
            if stream is None:
                stream = stream_of(dev)
            cfg = configs.get(stream) or config(stream)
            for i, cached, encode in maps:
                v = values[i]
                values[i] = (cached.get(v) if type(v) is tuple else None) or encode(v)
            acquire()  # (not `with`: half the cost)
            try:
                pack(view, 0, *(values if pick is None else pick(values)))
                err = cfg[1]()
            except struct.error as e:
                raise TypeError(f"{label}: bad launch argument: {e}") from None
            finally:
                release()
            if err:  # CUDA_SUCCESS is 0 in both paths
                self._failed(err, grid)

        return launch

    def _failed(self, err: int, grid: tuple):
        L = self.abi.launch
        check(drv.CUresult(err), f"cuLaunchKernelEx(grid={grid}, block={L.block}, cluster={L.cluster}, "
                                 f"smem={L.dynamic_smem_bytes})", self.label)

    def launch(self, grid: tuple, args: dict, stream: int | None = None, pdl: bool | None = None) -> None:
        """Launch on `stream` (a CUstream handle as int; default: torch's current stream).

        `args` maps every field name of the ABI to an int/float; for each tensor map spec,
        args[spec.tensor] is the 2-D torch tensor the map describes (or its (ptr, rows, cols, row_stride_elems)).
        `pdl` overrides the manifest's programmatic-stream-serialization attribute (False: a plain
        stream-ordered launch).
        """
        try:
            values = self._block.values(args)
        except KeyError as e:
            raise TypeError(f"{self.label}: launch argument {e.args[0]!r} missing") from None
        self.launch_ordered(grid, values, stream, pdl)

    def launch_ordered(self, grid: tuple, values: list, stream: int | None = None, pdl: bool | None = None) -> None:
        """`launch` with the values already in `param_names` order (a list: tensor maps are filled in place), through
        the kernel's launcher of (grid, pdl) (`launcher`, made on the first call)."""
        key = (grid, pdl)
        run = self._launchers.get(key)
        if run is None:
            if len(self._launchers) >= 256:
                self._launchers.clear()
            run = self._launchers[key] = self.launcher(grid, pdl=pdl)
        run(values, stream)


def _bindings_launch(cfg, func, kp: int) -> int:
    """cuda.bindings' cuLaunchKernelEx (where libcuda's cannot be called through ctypes): its error code."""
    return int(drv.cuLaunchKernelEx(cfg, func, kp, 0)[0])


def current_stream_getter():
    """f(device_index) -> torch's current stream on that device as a raw handle (the private accessor is ~10x
    faster than torch.cuda.current_stream; the public one where a torch build lacks it)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)


# ---------------------------------------------------------------- lookup
_LOADED: dict = {}
_LOAD_LOCK = threading.Lock()
_CACHES: dict = {}


def open_cache(cache_dir=None) -> Cache:
    """The cache kernels load from: --cache-dir (`cache_dir`) > $MUSEKERN_CACHE_DIR > the user cache dir (one
    Cache object per root in a process)."""
    root = str(default_cache_dir(cache_dir))
    c = _CACHES.get(root)
    if c is None:
        c = _CACHES[root] = Cache(root)
    return c


def device_arch(device_index: int) -> str:
    return targets.arch_for_capability(*device_info(device_index)["capability"])


def prepare_command(variant, arch: str, cache: Cache) -> str:
    """The exact command that builds `variant` for `arch` into `cache`."""
    name = targets.target_name_for_arch(arch)  # the local GPU's target (h200 on an H200), not the first
    tgt = f" --target {name}" if name else ""
    return f"musekern prepare{tgt} --variant '{variant.label}' --cache-dir {cache.root}"


def _missing(variant, arch: str, cache: Cache, parts, policy: Policy) -> MissingKernelError:
    near, diff = lookup.nearest(cache, parts)
    if policy.other_dsl:  # any DSL version's build would have served: not a difference worth naming
        diff = [d for d in diff if d != "dsl_version"]
    hint = ""
    if near is not None:
        hint = f" The nearest entry ({near.key[:12]}) differs in: {', '.join(diff)}."
    return MissingKernelError(
        f"no cached kernel for {variant.label} on {arch} in {cache.root}.{hint} "
        f"Build it with: {prepare_command(variant, arch, cache)}")


def find_entry(variant, arch: str, cache: Cache, on_miss=None):
    """The cache entry for `variant` on `arch`, by the runtime policy (store/lookup.py): any DSL version's
    build serves, unless an `on_miss` hook is given (MUSEKERN_AUTOBUILD: the ops pass the builder's) and the DSL is
    installed: then only this DSL version's build serves and an exact miss is `on_miss(variant, arch, cache, parts)`
    (an entry, or None). The runtime never imports the builder itself."""
    ver = dsl_version()
    policy = Policy.runtime(autobuild=on_miss is not None, dsl=ver)
    parts = key_parts(variant, arch, ver)
    entry = lookup.find(cache, parts, policy)
    if entry is None and on_miss is not None and ver is not None:
        entry = on_miss(variant, arch, cache, parts)
    if entry is None:
        raise _missing(variant, arch, cache, parts, policy)
    return entry


def load_artifact(variant, arch: str, cache: Cache, on_miss=None):
    """(entry, verified cubin bytes) of `variant` for `arch`: refuses another arch and corrupt bytes.

    Every manifest field the launch uses is checked with the cubin's bytes by `Cache.load` (store/manifest.py);
    a corrupt entry raises CorruptEntryError naming it and the fix. Counts a hit or a miss (store/hygiene.py).
    No GPU involved: the part of loading that tests can run anywhere.
    """
    try:
        got = _load_artifact(variant, arch, cache, on_miss)
    except (MissingKernelError, CacheError, ArchMismatchError):
        hygiene.count(cache, "miss")
        raise
    hygiene.count(cache, "hit")
    return got


def _load_artifact(variant, arch: str, cache: Cache, on_miss=None):
    entry = find_entry(variant, arch, cache, on_miss)
    try:
        entry, cubin = cache.load(entry.key)
    except MissingEntryError:  # removed (gc, clean) between the lookup and the load
        raise _missing(variant, arch, cache, key_parts(variant, arch, dsl_version()), Policy.runtime()) from None
    if entry.manifest.get("arch") != arch:
        raise ArchMismatchError(f"{variant.label}: cache entry {entry.key[:12]} was built for "
                                f"{entry.manifest.get('arch')}, this GPU is {arch}; "
                                f"{prepare_command(variant, arch, cache)}")
    try:
        elf_arch = cubin_arch(cubin)
    except ValueError as e:
        raise ArchMismatchError(f"{variant.label}: cache entry {entry.key[:12]} is not a cubin ({e}); "
                                f"{prepare_command(variant, arch, cache)}") from None
    if elf_arch != arch:
        raise ArchMismatchError(f"{variant.label}: the cubin of cache entry {entry.key[:12]} is for {elf_arch}, "
                                f"this GPU is {arch}; {prepare_command(variant, arch, cache)}")
    return entry, cubin


def get_kernel(variant, device: int | None = None, cache_dir=None, on_miss=None) -> LoadedKernel:
    """Load (once per process and device) the cached cubin of `variant` for the device's arch (`on_miss`: see
    `find_entry`)."""
    if device is None:
        import torch

        device = torch.cuda.current_device()
    key = (variant, device, cache_dir)
    k = _LOADED.get(key)
    if k is not None:
        return k
    with _LOAD_LOCK:
        k = _LOADED.get(key)
        if k is None:
            cache = open_cache(cache_dir)
            entry, cubin = load_artifact(variant, device_arch(device), cache, on_miss)
            cache.touch(entry.key)
            k = _LOADED[key] = LoadedKernel(entry, cubin, device)
    return k


def loaded_kernels() -> list[LoadedKernel]:
    return list(_LOADED.values())
