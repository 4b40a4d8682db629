"""What a cubin records about its own kernels, read from its ELF without any CUDA tool: the entry symbols and,
per kernel, the parameter sizes (EIATTR_KPARAM_INFO) and the required block size (EIATTR_REQNTID) that
ptxas writes into the `.nv.info.<symbol>` section.

The store checks a manifest's symbol and launch ABI against these, so an ABI record can only describe the
cubin it sits beside: this is how a machine without the compiler (which cannot recompute the ABI) still
knows the ABI belongs to that cubin. The launch configuration the cubin does NOT record (cluster, dynamic
shared memory, PDL, tensor-map encoding: DESIGN.md) is bound by the manifest's digest instead.

Read as bytes with every offset bounds-checked: a malformed ELF gives None (nothing to check against), never
an exception. Layout checked against cubins CuTe DSL 4.8.1 built for sm_90a (cuobjdump -elf shows the same).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

EIATTR_REQNTID = 0x10
EIATTR_KPARAM_INFO = 0x17
EIFMT_SVAL = 0x04  # a u16 size then that many bytes; the other formats are one 4-byte record


@dataclass(frozen=True)
class KernelInfo:
    param_sizes: tuple[int, ...]  # by ordinal
    block: tuple[int, int, int] | None  # the required block size, when the kernel declares one


def _sections(cubin: bytes) -> dict[str, tuple[int, int]] | None:
    """name -> (offset, size) of every section of an ELF64 little-endian file, or None if it is not one."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        return None
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    if shoff == 0 or shnum == 0 or shentsize < 64 or shstrndx >= shnum or shoff + shnum * shentsize > len(cubin):
        return None
    heads = []
    for i in range(shnum):
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        if off + size > len(cubin) and size:
            return None
        heads.append((name, off, size))
    str_off, str_size = heads[shstrndx][1], heads[shstrndx][2]
    out = {}
    for name, off, size in heads:
        if name >= str_size:
            return None
        end = cubin.find(b"\0", str_off + name, str_off + str_size)
        if end < 0:
            return None
        out[cubin[str_off + name:end].decode("latin-1")] = (off, size)
    return out


def _attributes(data: bytes):
    """(attribute, payload) of each EIATTR record of an .nv.info section; stops at a malformed one."""
    i = 0
    while i + 4 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == EIFMT_SVAL:
            size = struct.unpack_from("<H", data, i + 2)[0]
            if i + 4 + size > len(data):
                return
            yield attr, data[i + 4:i + 4 + size]
            i += 4 + size
        elif fmt in (1, 2, 3):
            yield attr, data[i + 2:i + 4]
            i += 4
        else:
            return


def kernels(cubin: bytes) -> dict[str, KernelInfo] | None:
    """symbol -> KernelInfo of every kernel the cubin describes, or None when it has no .nv.info sections
    (not a CUDA ELF: nothing to check a manifest against)."""
    try:
        secs = _sections(cubin)
    except struct.error:
        return None
    if not secs:
        return None
    out = {}
    for name, (off, size) in secs.items():
        if not name.startswith(".nv.info."):
            continue
        params: dict[int, int] = {}
        block = None
        for attr, payload in _attributes(cubin[off:off + size]):
            if attr == EIATTR_KPARAM_INFO and len(payload) >= 12:
                _, ordinal, _, flags = struct.unpack_from("<IHHI", payload)
                params[ordinal] = (flags >> 18) & 0x3FFF
            elif attr == EIATTR_REQNTID and len(payload) >= 12:
                block = struct.unpack_from("<III", payload)
        sizes = tuple(params[i] for i in range(len(params))) if set(params) == set(range(len(params))) else None
        if sizes is None:
            return None  # ordinals with a gap: a layout we do not know; check nothing rather than guess
        out[name[len(".nv.info."):]] = KernelInfo(sizes, block)
    return out or None


def abi_problems(cubin: bytes, symbol, abi: dict) -> list[str]:
    """Where the manifest's symbol and ABI disagree with what the cubin records ([] when they agree or the
    cubin records nothing). `abi` is the manifest's (already validated) ABI record."""
    found = kernels(cubin)
    if not found:
        return []
    info = found.get(symbol)
    if info is None:
        return [f"the cubin has no kernel {str(symbol)[:60]!r} (it has {len(found)} other): the manifest describes "
                "another build"]
    problems = []
    declared = tuple(p["size"] for p in abi["params"])
    if info.param_sizes != declared:
        problems.append(f"the cubin's kernel takes parameters of {list(info.param_sizes)} bytes, the manifest's ABI "
                        f"declares {list(declared)}")
    if info.block is not None and tuple(info.block) != tuple(abi["launch"]["block"]):
        problems.append(f"the cubin's kernel requires block {list(info.block)}, the manifest's launch says "
                        f"{list(abi['launch']['block'])}")
    return problems
