"""Fake cubin ELF headers with the e_flags CuTe DSL 4.8.1 writes (read off real cubins)."""
import struct

EM_CUDA = 190
# arch -> (EI_OSABI, EI_ABIVERSION, e_flags)
HEADERS = {"sm_90a": (0x33, 7, 0x5A0D5A), "sm_90": (0x33, 7, 0x5A055A), "sm_100a": (0x41, 8, 0x0600640A),
           "sm_100": (0x41, 8, 0x06006402)}


def elf_header(arch="sm_90a", payload=b"fake cubin body", machine=EM_CUDA) -> bytes:
    osabi, abiver, flags = HEADERS[arch]
    h = bytearray(64)
    h[:7] = b"\x7fELF\x02\x01\x01"  # ELF64, little endian, version 1
    h[7], h[8] = osabi, abiver
    struct.pack_into("<H", h, 0x12, machine)
    struct.pack_into("<I", h, 0x30, flags)
    return bytes(h) + payload
