"""The bounded tar reader (store/tarread.py) under bundle import: header bombs refused in bounded memory, GNU tar
re-packs read, traversal and links still refused.

The bombs are the issue's (a 512 MiB PAX header, a 1 GiB GNU long name, a 64 MiB index of empty objects) plus an
index of empty objects within the size cap. Each is generated streamed (a sparse file, or gzip written chunk by
chunk), so the test itself stays small; each import runs in a child process whose peak RSS (VmHWM) is read.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from musekern.store.bundle import INDEX_NAME, MAX_INDEX_BYTES, BundleError, export_bundle, import_bundle
from musekern.store.cache import Cache
from musekern.store.tarread import BLOCK

sys.path.insert(0, str(Path(__file__).parent))
from store_fakes import fake_parts, filled  # noqa: E402

PEAK_LIMIT_MB = 100


def _header(name: str, size: int, kind: bytes = b"0", magic: bytes = b"ustar\x0000") -> bytes:
    """One tar header block, checksummed (a base-256 size past 8 GiB-1 is not needed here)."""
    h = bytearray(BLOCK)
    h[:len(name.encode())] = name.encode()[:100]
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = f"{size:011o}\0".encode()
    h[136:148] = b"00000000000\0"
    h[156:157] = kind
    h[257:265] = magic
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}\0 ".encode()
    return bytes(h)


def _sparse_member(path: Path, kind: bytes, size: int) -> None:
    """A tar whose first member is a `kind` header announcing `size` bytes, then that many (sparse) zero bytes."""
    with open(path, "wb") as f:
        f.write(_header({b"L": "././@LongLink", b"x": "pax"}.get(kind, INDEX_NAME), size, kind))
        f.truncate(BLOCK + size + 2 * BLOCK)


def _gzip_member(path: Path, kind: bytes, size: int, fill: bytes) -> None:
    """The same as a gzip stream written chunk by chunk (the issue's 70 KB bundle)."""
    chunk = fill * ((1 << 20) // len(fill))
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(_header("pax" if kind == b"x" else INDEX_NAME, size, kind))
        left = size
        while left:
            f.write(chunk[:left])
            left -= min(left, len(chunk))
        f.write(b"\0" * (-size % BLOCK + 2 * BLOCK))


def _index_bomb(path: Path, size: int) -> None:
    """A tar whose index is `size` bytes of `[{},{},...]` (the issue's 64 MiB index of empty objects)."""
    body = b'{"bundle_format": 1, "entries": [' + b"{}," * ((size - 40) // 3) + b"{}]}"
    body += b" " * (size - len(body))
    with open(path, "wb") as f:
        f.write(_header(INDEX_NAME, len(body)))
        f.write(body + b"\0" * (-len(body) % BLOCK) + b"\0" * 2 * BLOCK)


def _import_in_child(bundle: Path, cache: Path) -> tuple[int, str, float]:
    """(exit code, stderr, peak RSS in MB) of `musekern import` in a child process."""
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child of this (torch-loaded)
    # pytest process would report the parent's peak
    code = ("import sys\nfrom musekern.cli import main\n"
            "try:\n    main(['import', sys.argv[1], '--cache-dir', sys.argv[2]])\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
            "print(hwm)\nsys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(bundle), str(cache)], capture_output=True, text=True,
                       timeout=300)
    return r.returncode, r.stderr, int(r.stdout.strip().splitlines()[-1]) / 1024


def _baseline_mb(tmp_path) -> float:
    """The peak RSS of importing a small sound bundle: the interpreter, click and musekern."""
    c = filled(tmp_path / "src", [0, 1])
    export_bundle(c, [fake_parts(i).key() for i in (0, 1)], tmp_path / "ok.tar")
    rc, err, peak = _import_in_child(tmp_path / "ok.tar", tmp_path / "ok-cache")
    assert rc == 0, err
    return peak


BOMBS = {  # name -> (maker, what the one-line error says)
    "512 MiB PAX header (sparse)": (lambda p: _sparse_member(p, b"x", 512 << 20), "PAX header of 536870912 bytes"),
    "512 MiB PAX header (gzip)": (lambda p: _gzip_member(p, b"x", 512 << 20, b"99 path=" + b"a" * 56),
                                  "PAX header of 536870912 bytes"),
    "1 GiB GNU long name (sparse)": (lambda p: _sparse_member(p, b"L", 1 << 30), "GNU long name of 1073741824"),
    "64 MiB index (sparse size)": (lambda p: _sparse_member(p, b"0", 64 << 20), "is 67108864 bytes (limit"),
    "64 MiB index of empty objects": (lambda p: _index_bomb(p, 64 << 20), "is 67108864 bytes (limit"),
    "4 MiB index of empty objects": (lambda p: _index_bomb(p, MAX_INDEX_BYTES), "holds more than"),
}


@pytest.mark.parametrize("bomb", BOMBS)
def test_header_bombs_are_refused_in_one_line_and_bounded_memory(tmp_path, bomb):
    make, says = BOMBS[bomb]
    path = tmp_path / ("b.tar.gz" if "gzip" in bomb else "b.tar")
    make(path)
    assert os.stat(path).st_blocks * 512 < 80 << 20  # the test's own files stay small (sparse or compressed)
    rc, err, peak = _import_in_child(path, tmp_path / "cache")
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("musekern: error:") and says in lines[0], err[:2000]
    assert len(lines[0]) < 600
    assert peak < PEAK_LIMIT_MB, f"{bomb}: peak RSS {peak:.0f} MB"
    print(f"{bomb}: refused, peak RSS {peak:.1f} MB (baseline {_baseline_mb(tmp_path):.1f} MB)")


@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])  # GNU tar's own format, PAX (with its records), plain
def test_a_gnu_tar_repack_of_an_extracted_bundle_imports(tmp_path, fmt):
    if shutil.which("tar") is None:
        pytest.skip("needs GNU tar")
    c = filled(tmp_path / "src", [0, 1, 2])
    keys = [fake_parts(i).key() for i in (0, 1, 2)]
    export_bundle(c, keys, tmp_path / "b.tar.gz")
    d = tmp_path / "x"
    d.mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / "b.tar.gz"), "-C", str(d)], check=True)
    out = tmp_path / "re.tar"
    subprocess.run(["tar", f"--format={fmt}", "-cf", str(out), "-C", str(d), "."], check=True)
    names = tarfile.open(out).getnames()
    assert names[0] in ("./", ".") and any(n.endswith("/") or n.startswith("./entries") for n in names)
    report = import_bundle(Cache(tmp_path / "dst"), out)
    assert report.ok and sorted(report.added) == sorted(keys)


@pytest.mark.parametrize("plant", [  # real traversal in a re-pack: still refused, whole bundle
    "../escape", "/abs/path", "entries/../../x", "./entries/" + "a" * 64 + "/../../../x", "link", "hardlink", "fifo",
    "stray dir",
])
def test_traversal_links_and_strays_in_a_repack_are_refused(tmp_path, plant):
    c = filled(tmp_path / "src", [0])
    export_bundle(c, [fake_parts(0).key()], tmp_path / "b.tar")
    good = tarfile.open(tmp_path / "b.tar")
    out = tmp_path / "bad.tar"
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for m in good.getmembers():
            tar.addfile(m, good.extractfile(m))
        ti = tarfile.TarInfo(plant)
        if plant in ("link", "hardlink"):
            ti.name = f"./entries/{fake_parts(1).key()}/kernel.cubin"
            ti.type, ti.linkname = (tarfile.SYMTYPE if plant == "link" else tarfile.LNKTYPE), "/etc/passwd"
        elif plant == "fifo":
            ti.name, ti.type = f"entries/{fake_parts(1).key()}/kernel.cubin", tarfile.FIFOTYPE
        elif plant == "stray dir":
            ti.name, ti.type = "./etc/", tarfile.DIRTYPE
        tar.addfile(ti, io.BytesIO(b""))
    dst = Cache(tmp_path / "dst")
    with pytest.raises(BundleError) as e:
        import_bundle(dst, out)
    assert "\n" not in str(e.value) and "nothing was imported" in str(e.value)
    assert not dst.entries_dir.exists() or not list(dst.entries_dir.iterdir())


@pytest.mark.parametrize("damage", ["truncated header", "truncated data", "bad checksum", "bad gzip", "empty",
                                    "PAX record malformed", "name too long"])
def test_damaged_archives_are_one_line_errors(tmp_path, damage):
    c = filled(tmp_path / "src", [0])
    export_bundle(c, [fake_parts(0).key()], tmp_path / "b.tar")
    raw = (tmp_path / "b.tar").read_bytes()
    bad = {"truncated header": raw[:BLOCK + 100], "truncated data": raw[:BLOCK + 200],
           "bad checksum": raw[:148] + b"7777777\0" + raw[156:], "bad gzip": b"\x1f\x8b" + b"\0" * 100,
           "empty": b"", "PAX record malformed": _header("pax", 20, b"x") + b"99 nonsense\n".ljust(BLOCK, b"\0"),
           "name too long": _header("long", 5000, b"L") + b"a" * 5000}[damage]
    (tmp_path / "bad.tar").write_bytes(bad)
    with pytest.raises(BundleError) as e:
        import_bundle(Cache(tmp_path / "dst"), tmp_path / "bad.tar")
    assert "\n" not in str(e.value) and len(str(e.value)) < 700


def test_an_index_within_its_caps_but_listing_too_many_entries_is_refused(tmp_path, monkeypatch):
    from musekern.store import bundle as bundle_mod

    monkeypatch.setattr(bundle_mod, "MAX_INDEX_ENTRIES", 3)
    index = {"bundle_format": 1, "entries": [{"key": str(i)} for i in range(4)]}
    data = json.dumps(index).encode()
    (tmp_path / "b.tar").write_bytes(_header(INDEX_NAME, len(data)) + data.ljust(BLOCK, b"\0") + bytes(2 * BLOCK))
    with pytest.raises(BundleError, match="lists 4 entries, more than 3"):
        import_bundle(Cache(tmp_path / "dst"), tmp_path / "b.tar")
