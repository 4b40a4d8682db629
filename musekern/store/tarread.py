"""A bounded tar reader for bundles: every header is read in 512-byte blocks and every size is checked against a
cap BEFORE anything is allocated for it (tarfile reads PAX and GNU long-name headers whole first: a 70 KB bundle
with a 512 MiB PAX header took 6.7 GB). Stdlib only.

Reads plain, gzip, bzip2 and xz tars as a stream (decompressed as read, never whole): USTAR (with its prefix
field), GNU (`L` long names, `K` long links) and POSIX/PAX (`x` per-member and `g` global records: path,
linkpath and size are honoured, the rest ignored). Each member is reported with its kind ("file", "dir",
"link", "other"); the caller decides what it accepts and which members' bytes to read. Stops at the first
end-of-archive block. Every error is a TarProblem of one line, names cut to 120 characters.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator

BLOCK = 512
MAX_LONG_NAME = 4096  # a GNU long name or link, or a PAX path: PATH_MAX
MAX_PAX = 64 << 10  # one PAX record set (a real one is ~100 bytes: path, mtime)
MAX_HEADERS = 400_000  # header blocks of any kind (a member can take 3: a PAX, a long name, its own)
_SKIP_CHUNK = 1 << 20
_REGULAR, _DIR, _LINKS = (b"0", b"\0", b"7"), b"5", (b"1", b"2")
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, FIFOs: their size field is not data


class TarProblem(Exception):
    """The archive is not a tar we read, is damaged, or exceeds a cap (one line)."""


def show(name: str, n: int = 120) -> str:
    """A name fit for a one-line message: repr, cut to `n` characters."""
    return repr(name[:n]) + (f"... ({len(name)} characters)" if len(name) > n else "")


@dataclass(frozen=True)
class Member:
    name: str
    kind: str  # "file" | "dir" | "link" | "other"
    size: int  # bytes of data that follow (files; 0 for the rest, whose data is skipped)
    offset: int  # where its header starts in the (decompressed) stream


def open_stream(f: BinaryIO) -> BinaryIO:
    """`f` itself, or a decompressing reader over it, by its magic bytes (gzip, bzip2, xz)."""
    head = f.peek(6)[:6] if hasattr(f, "peek") else b""
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb")
    if head[:3] == b"BZh":
        return bz2.BZ2File(f, mode="rb")
    if head[:6] == b"\xfd7zXZ\x00":
        return lzma.LZMAFile(f, mode="rb")
    return f


def _nts(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes, what: str, at: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256: a size of 8 GiB or more
        if field[0] != 0x80:
            raise TarProblem(f"negative or oversized {what} in the header at byte {at}")
        return int.from_bytes(field[1:], "big")
    text = field.replace(b"\0", b" ").strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarProblem(f"bad {what} {show(text.decode('latin-1'), 20)} in the header at byte {at}: not a tar "
                         "archive, or a damaged one") from None


def _pax(data: bytes, at: int) -> dict[str, str]:
    """The records of a PAX header ("%d %s=%s\\n" each)."""
    out, i = {}, 0
    while i < len(data):
        if data[i:i + 1] == b"\0":  # padding
            break
        sp = data.find(b" ", i, i + 12)
        try:
            n = int(data[i:sp]) if sp > i else 0
        except ValueError:
            n = 0
        rec = data[i:i + n]
        if n <= sp - i + 1 or len(rec) != n or not rec.endswith(b"\n") or b"=" not in rec:
            raise TarProblem(f"malformed PAX record in the header at byte {at}")
        key, _, value = rec[sp - i + 1:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        i += n
    return out


class Reader:
    """Iterate `members()`; while a member is current, `read(n)` returns up to `n` of its bytes (the caller
    checked its size first); what is not read is skipped in bounded chunks."""

    def __init__(self, stream: BinaryIO):
        self._f = stream
        self.pos = 0  # bytes consumed from the decompressed stream
        self._left = 0  # data bytes of the current member not yet consumed
        self._pad = 0

    def _read(self, n: int) -> bytes:
        data = self._f.read(n)
        self.pos += len(data)
        return data

    def _exact(self, n: int, what: str) -> bytes:
        data = self._read(n)
        if len(data) != n:
            raise TarProblem(f"truncated: {what} at byte {self.pos - len(data)} ends after {len(data)} of {n} bytes")
        return data

    def _skip(self, n: int) -> None:
        while n > 0:
            got = len(self._exact(min(n, _SKIP_CHUNK), "member data"))
            n -= got

    def read(self, n: int) -> bytes:
        n = min(n, self._left)
        data = self._exact(n, "member data")
        self._left -= n
        return data

    def _finish_member(self) -> None:
        self._skip(self._left + self._pad)
        self._left = self._pad = 0

    def _body(self, size: int, cap: int, what: str, at: int) -> bytes:
        if size > cap:
            raise TarProblem(f"{what} of {size} bytes at byte {at} (limit {cap}; a header bomb?)")
        data = self._exact(size, what)
        self._skip(-size % BLOCK)
        return data

    def members(self) -> Iterator[Member]:
        long_name = long_link = None
        pax: dict[str, str] = {}
        for _ in range(MAX_HEADERS):
            self._finish_member()
            at = self.pos
            block = self._read(BLOCK)
            if not block and at == 0:
                raise TarProblem("empty file: not a tar archive")
            if not block or block == bytes(BLOCK):  # end of archive (a missing end marker is tolerated)
                return
            if len(block) != BLOCK:
                raise TarProblem(f"truncated: the header at byte {at} has {len(block)} of {BLOCK} bytes")
            want = _number(block[148:156], "checksum", at)
            plain = sum(block[:148]) + 8 * 32 + sum(block[156:])
            signed = plain - 2 * sum(b for b in block[:148] + block[156:] if b > 127)
            if want not in (plain, signed):
                raise TarProblem(f"no tar header at byte {at} (bad checksum): not a tar archive, or a damaged one")
            kind, size = block[156:157], _number(block[124:136], "size", at)
            if kind in (b"x", b"g"):
                records = _pax(self._body(size, MAX_PAX, "a PAX header", at), at)
                if kind == b"x":
                    pax = records
                continue
            if kind in (b"L", b"K"):
                text = _nts(self._body(size, MAX_LONG_NAME, "a GNU long name" if kind == b"L" else "a GNU long "
                                       "link", at))
                long_name, long_link = (text, long_link) if kind == b"L" else (long_name, text)
                continue
            name = _nts(block[:100])
            if block[257:263] == b"ustar\0" and block[345:500].strip(b"\0"):
                name = _nts(block[345:500]) + "/" + name
            name = pax.get("path", long_name if long_name is not None else name)
            if "size" in pax:
                if not pax["size"].isdigit() or len(pax["size"]) > 20:
                    raise TarProblem(f"bad PAX size {show(pax['size'], 24)} at byte {at}")
                size = int(pax["size"])
            if len(name) > MAX_LONG_NAME:
                raise TarProblem(f"member name of {len(name)} characters at byte {at} (limit {MAX_LONG_NAME})")
            has_link = long_link is not None or "linkpath" in pax
            long_name = long_link = None
            pax = {}
            kind_s = ("file" if kind in _REGULAR else "dir" if kind == _DIR else "link" if kind in _LINKS or has_link
                      else "other")
            data_size = 0 if kind in _NO_DATA else size  # skipped unless the caller reads it (files only)
            self._left, self._pad = data_size, -data_size % BLOCK
            yield Member(name, kind_s, size if kind_s == "file" else 0, at)
        raise TarProblem(f"more than {MAX_HEADERS} headers")


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged compressed stream raises (besides TarProblem)."""
    return (OSError, EOFError, lzma.LZMAError, zlib.error)
