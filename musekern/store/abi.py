"""Kernel launch ABI: what the loader must pack and how it must launch a cached cubin.

This module is pure Python (no cutlass, no CUDA): kernels declare their ABI with these
dataclasses next to their CuTe DSL source, the builder checks it against the PTX
`.entry` signature of the compiled cubin and writes it into the cache manifest, and
the runtime loader packs kernel parameters from the manifest alone.

Facts this encodes (shared/cute-dsl/NOTES.md §3, verified by compile and on an H200):
- PTX parameters appear in Python argument order; fully static arguments produce none.
- a `cute.Pointer` (gmem) is `.param .u64 .ptr .global .align A`: 8 bytes;
- `Int32`/`Float32`/`Int64`/`Boolean` are `.u32`/`.f32`/`.u64`/`.u8`;
- a `cute.Tensor` is `.param .align 8 .b8 [N]`: {u64 ptr; dynamic shape entries; dynamic
  stride entries}, natural alignment, padded to 8;
- a TMA atom is `.param .align 64 .b8 [128]`: the CUtensorMap by value;
- a TMA coordinate tensor with a dynamic shape is `.param .align 4 .b8 [4*n]`.
Parameters are passed to cuLaunchKernelEx as an array of pointers (one host buffer each).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

ABI_VERSION = 1  # bump when the meaning of any manifest field below changes

# field type -> (size in bytes, struct/int signedness or float)
FIELD_TYPES = {
    "u8": 1, "i32": 4, "u32": 4, "f32": 4, "i64": 8, "u64": 8, "bytes": None,
}
# PTX scalar parameter spelling -> our field type
_PTX_SCALAR = {"u8": "u8", "b8": "u8", "s8": "u8", "u32": "u32", "s32": "i32", "b32": "u32", "f32": "f32",
               "u64": "u64", "s64": "i64", "b64": "u64"}


@dataclass(frozen=True)
class Field:
    """One value inside a parameter: `name` is looked up in the values the caller passes."""
    name: str
    type: str
    offset: int
    size: int

    def __post_init__(self):
        if self.type not in FIELD_TYPES:
            raise ValueError(f"field {self.name!r}: unknown type {self.type!r}")
        want = FIELD_TYPES[self.type]
        if want is not None and want != self.size:
            raise ValueError(f"field {self.name!r}: type {self.type} has size {want}, not {self.size}")


@dataclass(frozen=True)
class Param:
    """One PTX kernel parameter (one entry of kernelParams)."""
    name: str
    kind: str  # "scalar" | "pointer" | "struct" | "tensormap"
    align: int
    size: int
    fields: tuple[Field, ...]
    doc: str = ""

    def __post_init__(self):
        for f in self.fields:
            if f.offset + f.size > self.size:
                raise ValueError(f"param {self.name!r}: field {f.name!r} overruns {self.size} bytes")


@dataclass(frozen=True)
class TensorMapSpec:
    """How the loader encodes the CUtensorMap of one TMA parameter with cuTensorMapEncodeTiled.

    The global tensor is `tensor` (a name the op passes) viewed as a row-major 2-D matrix
    [rows, cols]; dims/strides are read from it at encode time. `box` is (cols, rows) in
    elements, innermost first, as cuTensorMapEncodeTiled takes it.
    """
    param: str
    tensor: str
    dtype: str  # "bf16" | "f16" | "f32"
    box: tuple[int, int]
    swizzle: str = "128B"  # "none" | "32B" | "64B" | "128B"
    l2_promotion: str = "128B"  # "none" | "64B" | "128B" | "256B"
    oob_fill: str = "none"  # "none" | "nan"
    interleave: str = "none"


@dataclass(frozen=True)
class LaunchSpec:
    """The launch configuration, which is NOT recorded in the cubin (NOTES.md §4)."""
    block: tuple[int, int, int]
    cluster: tuple[int, int, int] = (1, 1, 1)
    dynamic_smem_bytes: int = 0
    pdl: bool = False
    grid: str = ""  # human-readable rule; the op computes the grid


@dataclass(frozen=True)
class KernelAbi:
    params: tuple[Param, ...]
    launch: LaunchSpec
    tensormaps: tuple[TensorMapSpec, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {
            "abi_version": ABI_VERSION,
            "params": [
                {"name": p.name, "kind": p.kind, "align": p.align, "size": p.size, "doc": p.doc,
                 "fields": [{"name": f.name, "type": f.type, "offset": f.offset, "size": f.size} for f in p.fields]}
                for p in self.params
            ],
            "launch": {"block": list(self.launch.block), "cluster": list(self.launch.cluster),
                       "dynamic_smem_bytes": self.launch.dynamic_smem_bytes, "pdl": self.launch.pdl,
                       "grid": self.launch.grid},
            "tensormaps": [
                {"param": t.param, "tensor": t.tensor, "dtype": t.dtype, "box": list(t.box), "swizzle": t.swizzle,
                 "l2_promotion": t.l2_promotion, "oob_fill": t.oob_fill, "interleave": t.interleave}
                for t in self.tensormaps
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> "KernelAbi":
        if d.get("abi_version") != ABI_VERSION:
            raise ValueError(f"manifest ABI version {d.get('abi_version')!r} != {ABI_VERSION} (rebuild the cache)")
        params = tuple(
            Param(p["name"], p["kind"], p["align"], p["size"],
                  tuple(Field(f["name"], f["type"], f["offset"], f["size"]) for f in p["fields"]), p.get("doc", ""))
            for p in d["params"])
        L = d["launch"]
        launch = LaunchSpec(tuple(L["block"]), tuple(L["cluster"]), L["dynamic_smem_bytes"], L["pdl"], L["grid"])
        tms = tuple(TensorMapSpec(t["param"], t["tensor"], t["dtype"], tuple(t["box"]), t["swizzle"],
                                  t["l2_promotion"], t["oob_fill"], t["interleave"]) for t in d["tensormaps"])
        return cls(params, launch, tms)

    def signature(self) -> list[tuple[int, int]]:
        """(align, size) per parameter, as the PTX `.entry` declares it."""
        return [(p.align, p.size) for p in self.params]


# ---------------------------------------------------------------- declaration helpers
def scalar(name: str, type: str, doc: str = "") -> Param:
    size = FIELD_TYPES[type]
    return Param(name, "scalar", size, size, (Field(name, type, 0, size),), doc)


def pointer(name: str, doc: str = "") -> Param:
    """A `cute.Pointer` argument: `.param .u64 .ptr .global .align A` (8 bytes at 8-byte host alignment)."""
    return Param(name, "pointer", 8, 8, (Field(name, "u64", 0, 8),), doc)


def tensor(name: str, shape: tuple[str, ...] = (), stride: tuple[str, ...] = (), stride_type: str = "i64",
           shape_type: str = "i32", doc: str = "") -> Param:
    """A `cute.Tensor` argument: {u64 ptr `name`; dynamic shape values; dynamic stride values}.

    `shape`/`stride` name only the *dynamic* entries in mode order (static ones take no bytes).
    """
    fields, off = [Field(name, "u64", 0, 8)], 8
    for names, t in ((shape, shape_type), (stride, stride_type)):
        sz = FIELD_TYPES[t]
        for n in names:
            off = (off + sz - 1) // sz * sz
            fields.append(Field(n, t, off, sz))
            off += sz
    size = (off + 7) // 8 * 8
    return Param(name, "struct", 8, size, tuple(fields), doc)


def tensormap(name: str, doc: str = "") -> Param:
    return Param(name, "tensormap", 64, 128, (Field(name, "bytes", 0, 128),), doc)


def coord_tensor(name: str, shape: tuple[str, ...], doc: str = "") -> Param:
    """The TMA coordinate tensor of a `make_tiled_tma_atom`: its dynamic shape values only (i32 each)."""
    fields = tuple(Field(n, "i32", 4 * i, 4) for i, n in enumerate(shape))
    return Param(name, "struct", 4, 4 * len(shape), fields, doc)


# ---------------------------------------------------------------- PTX checks
def ptx_entry_names(ptx: str) -> list[str]:
    return re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(", ptx)


def ptx_entry_params(ptx: str, symbol: str) -> list[tuple[int, int]]:
    """Ordered (align, size) of every `.param` of `.entry symbol`, from the PTX signature."""
    m = re.search(r"\.entry\s+" + re.escape(symbol) + r"\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise ValueError(f".entry {symbol} not found in PTX")
    out = []
    body = m.group(1).strip()
    if not body:
        return out
    for p in body.split(","):
        p = " ".join(p.split())
        a = re.match(r"\.param \.align (\d+) \.b8 \S+\[(\d+)\]$", p)
        if a:
            out.append((int(a.group(1)), int(a.group(2))))
            continue
        s = re.match(r"\.param \.(u|s|b|f)(\d+)\b", p)
        if not s:
            raise ValueError(f"unparsed PTX param of {symbol}: {p!r}")
        n = int(s.group(2)) // 8
        out.append((n, n))
    return out


def check_abi_against_ptx(abi: KernelAbi, ptx: str, symbol: str) -> None:
    """Raise ValueError unless the declared ABI equals the PTX `.entry` signature."""
    got = ptx_entry_params(ptx, symbol)
    want = abi.signature()
    if got != want:
        declared = [(p.name, p.align, p.size) for p in abi.params]
        raise ValueError(f"kernel ABI mismatch for {symbol}:\n  declared {declared}\n  PTX      {got}")


# ---------------------------------------------------------------- the cubin's ELF header
EM_CUDA = 190  # ELF e_machine of a cubin


def cubin_arch(cubin: bytes) -> str:
    """The SM a cubin was compiled for, from its ELF header: 'sm_90a', 'sm_100a', 'sm_80', ...

    CUDA ELF ABI v7 (up to sm_90): SM in e_flags bits 0-7, arch-specific ('a') flag 0x800.
    ABI v8 (sm_100 on): SM in bits 8-15, 'a' flag 0x8. Checked against cubins built for
    sm_80, sm_90, sm_90a and sm_100a by CuTe DSL 4.8.1. Raises ValueError for bytes that are not one.
    """
    if len(cubin) < 0x34 or cubin[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    machine = struct.unpack_from("<H", cubin, 0x12)[0]
    if machine != EM_CUDA:
        raise ValueError(f"ELF machine {machine} is not CUDA ({EM_CUDA})")
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    if cubin[8] >= 8:
        sm, accel = (flags >> 8) & 0xFF, bool(flags & 0x8)
    else:
        sm, accel = flags & 0xFF, bool(flags & 0x800)
    return f"sm_{sm}{'a' if accel else ''}"
