"""manifest.json: its one bounded JSON parser, its canonical bytes, its digest, and the checks every reader of
an entry applies (Cache.load and verify, bundle import, remote pull).

How every field that reaches a launch or a lookup is bound to the cubin's hash and to the key:

- `digest` is sha256 over the canonical JSON of every other field: format, key, key_parts, kernel, arch,
  variant, label, symbol, abi (parameters and their fields, launch block/cluster/smem/PDL, tensor maps),
  cubin_sha256, cubin_size, built_with. And the file must be byte for byte its canonical serialisation. So a
  change of any byte is caught: it breaks the JSON, or changes a value (the digest differs), or changes only
  the spelling (the bytes are not canonical). A bit flip in the digest itself no longer matches the rest.
- What can be re-derived is re-derived, not trusted: key_parts hash to the key (the directory name, the key
  asked for); kernel, arch, variant and label must be what key_parts say; the ABI's version is the key's.
- The cubin is checked against cubin_sha256/cubin_size (Cache), and against what the cubin records about
  itself (store/elf.py): the entry symbol, its parameter sizes and its required block size.
- Every value has its type and bound checked, so a hostile record (nested JSON, 1e999, a 10**12-byte
  parameter) is a problem naming the field, never a crash of the loader.

- The ABI must be the one the key's variant declares (store/variant_abi.py, a hook the package layer fills)
  and a CUDA ELF cubin must be built for the key's arch.
- `signatures` (store/signing.py), when present, are well formed and covered by the digest; whether they
  verify is asked only of entries from a remote or a bundle on a machine that trusts keys.

The digest is not a signature: whoever rewrites a manifest and recomputes the digest defeats it. What it
catches is bit rot, truncation, hand edits and mix-ups; forgeries that stay consistent are caught as far as
the key, the variant's declared ABI and the cubin allow (another variant's parts do not hash to this key;
another variant's ABI is not this variant's; another variant's cubin does not have this symbol and ABI).
What is left (a sibling build with the very same ABI and symbol) only a signature refuses.
"""
from __future__ import annotations

import json
import math
import re

from . import variant_abi
from .abi import ABI_VERSION, FIELD_TYPES, KernelAbi, cubin_arch
from .keys import KeyParts, canonical_json, is_key, sha256_hex
from .signing import SIGNATURES, signature_problems

CACHE_FORMAT = 2  # 2: keys leave variant fields at their default out, source hash over the variant's files,
#                      manifests carry `digest` (changed before v2 was released: a v2 entry without it is corrupt)
MAX_MANIFEST_BYTES = 1 << 20
MAX_CUBIN_BYTES = 64 << 20  # real cubins are 10-500 KB; a bigger declared size is not a kernel of ours
MAX_JSON_DEPTH = 32  # a manifest nests 6 deep (abi.params[].fields[]); bundle indexes 3
MAX_INT_DIGITS = 20
MAX_JSON_ITEMS = 1 << 16  # objects, arrays and separators: a manifest has a few hundred; bounds what parsing allocates
DIGEST = "digest"

_SYMBOL_RE = re.compile(r"^[A-Za-z_$][\w$]{0,4095}$")
_NAME_RE = re.compile(r"^[A-Za-z_][\w.]{0,255}$")
_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET_RE = re.compile(rb"[\[\]{}]")
_KINDS = ("scalar", "pointer", "struct", "tensormap")
_ALIGNS = (1, 2, 4, 8, 16, 32, 64, 128)
_TENSORMAP = {"dtype": ("bf16", "f16", "f32", "u8"),  # u8: e4m3 bytes (runtime/tensormap.py encodes each)
              "swizzle": ("none", "32B", "64B", "128B"),
              "l2_promotion": ("none", "64B", "128B", "256B"), "oob_fill": ("none", "nan"), "interleave": ("none",)}
MAX_PARAM_SPACE = 32764  # bytes of kernel parameters CUDA accepts (12.1 and later)


# ---------------------------------------------------------------- bounded JSON
def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:24]} is out of range")
    return x


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits")
    return int(text)


def _no_constant(text: str):
    raise ValueError(f"{text} is not JSON")


def json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of JSON text (strings skipped); stops counting past `limit`."""
    depth = best = 0
    for m in _BRACKET_RE.finditer(_STRING_RE.sub(b'""', raw)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > best:
            best = depth
            if best > limit:
                break
    return best


def parse_json(raw: bytes, what: str, max_depth: int = MAX_JSON_DEPTH, max_items: int | None = None):
    """JSON from bytes, bounded: at most `max_depth` nested arrays/objects, at most `max_items` (if given) objects,
    arrays and commas (counted before parsing, strings included: an upper bound on the values it would allocate),
    finite numbers, integers of at most 20 digits, no NaN/Infinity. Raises ValueError (one line naming `what`)
    otherwise; never RecursionError, OverflowError or MemoryError for a file within its size cap."""
    items = 0 if max_items is None else raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if max_items is not None and items > max_items:
        raise ValueError(f"{what} holds more than {max_items} values (not one of ours)")
    if json_depth(raw, max_depth) > max_depth:
        raise ValueError(f"{what} nests deeper than {max_depth} levels (not one of ours)")
    try:
        text = raw.decode("utf-8")
        return json.loads(text, parse_float=_finite, parse_int=_bounded_int, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"{what} nests too deep") from None
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON ({str(e).splitlines()[0][:120]})") from None


# ---------------------------------------------------------------- canonical bytes and digest
def manifest_bytes(manifest: dict) -> bytes:
    """How manifest.json is written (human-readable but deterministic: bundles compare bytes)."""
    return (json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode()


def digest_of(manifest: dict) -> str:
    """sha256 over the canonical JSON of every field but the digest itself."""
    return sha256_hex(canonical_json({k: v for k, v in manifest.items() if k != DIGEST}))


def seal(manifest: dict) -> dict:
    """The manifest with its digest (replacing any it had)."""
    out = {k: v for k, v in manifest.items() if k != DIGEST}
    out[DIGEST] = digest_of(out)
    return out


# ---------------------------------------------------------------- checks
def _int(v, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], not {str(v)[:40]!r}")
    return v


def _str(v, what: str, pattern: re.Pattern | None = None, choices=None) -> str:
    if not isinstance(v, str) or (pattern is not None and not pattern.match(v)) or (choices and v not in choices):
        want = f"one of {', '.join(choices)}" if choices else "a name" if pattern else "a string"
        raise ValueError(f"{what} must be {want}, not {str(v)[:40]!r}")
    return v


def _list(v, n_max: int, what: str, n: int | None = None) -> list:
    if not isinstance(v, list) or len(v) > n_max or (n is not None and len(v) != n):
        raise ValueError(f"{what} must be a list of {n if n is not None else f'at most {n_max}'} items")
    return v


def _obj(v, what: str, keys) -> dict:
    if not isinstance(v, dict) or not set(keys) <= set(v):
        raise ValueError(f"{what} must be an object with {', '.join(keys)}")
    return v


def check_abi(abi) -> None:
    """Raise ValueError naming the first field of a launch-ABI record that is missing, mistyped or out of
    bounds (the loader allocates and packs from these numbers)."""
    abi = _obj(abi, "abi", ("abi_version", "params", "launch", "tensormaps"))
    _int(abi["abi_version"], ABI_VERSION, ABI_VERSION, "abi.abi_version")
    space, tmap_params = 0, set()
    for i, p in enumerate(_list(abi["params"], 256, "abi.params")):
        w = f"abi.params[{i}]"
        p = _obj(p, w, ("name", "kind", "align", "size", "fields"))
        _str(p["name"], f"{w}.name", _NAME_RE)
        kind = _str(p["kind"], f"{w}.kind", choices=_KINDS)
        align = _int(p["align"], 1, 128, f"{w}.align")
        if align not in _ALIGNS:
            raise ValueError(f"{w}.align must be a power of two, not {align}")
        size = _int(p["size"], 1, 4096, f"{w}.size")
        space += size
        _str(p.get("doc", ""), f"{w}.doc")
        if kind == "tensormap":
            tmap_params.add(p["name"])
        for j, f in enumerate(_list(p["fields"], 64, f"{w}.fields")):
            fw = f"{w}.fields[{j}]"
            f = _obj(f, fw, ("name", "type", "offset", "size"))
            _str(f["name"], f"{fw}.name", _NAME_RE)
            _str(f["type"], f"{fw}.type", choices=tuple(FIELD_TYPES))
            _int(f["offset"], 0, size - 1, f"{fw}.offset")
            _int(f["size"], 1, size, f"{fw}.size")
    if space > MAX_PARAM_SPACE:
        raise ValueError(f"abi.params take {space} bytes, more than CUDA's {MAX_PARAM_SPACE}")
    launch = _obj(abi["launch"], "abi.launch", ("block", "cluster", "dynamic_smem_bytes", "pdl", "grid"))
    block = [_int(x, 1, 1024, "abi.launch.block[]") for x in _list(launch["block"], 3, "abi.launch.block", 3)]
    if block[0] * block[1] * block[2] > 1024:
        raise ValueError(f"abi.launch.block {block} has more than 1024 threads")
    cluster = [_int(x, 1, 16, "abi.launch.cluster[]") for x in _list(launch["cluster"], 3, "abi.launch.cluster", 3)]
    if cluster[0] * cluster[1] * cluster[2] > 16:
        raise ValueError(f"abi.launch.cluster {cluster} has more than 16 CTAs")
    _int(launch["dynamic_smem_bytes"], 0, 1 << 20, "abi.launch.dynamic_smem_bytes")
    if type(launch["pdl"]) is not bool:
        raise ValueError("abi.launch.pdl must be true or false")
    _str(launch["grid"], "abi.launch.grid")
    for i, t in enumerate(_list(abi["tensormaps"], 64, "abi.tensormaps")):
        w = f"abi.tensormaps[{i}]"
        t = _obj(t, w, ("param", "tensor", "dtype", "box", *_TENSORMAP))
        if t["param"] not in tmap_params:
            raise ValueError(f"{w}.param {str(t['param'])[:40]!r} is not a tensormap parameter")
        _str(t["tensor"], f"{w}.tensor", _NAME_RE)
        for name, choices in _TENSORMAP.items():
            _str(t[name], f"{w}.{name}", choices=choices)
        [_int(x, 1, 256, f"{w}.box[]") for x in _list(t["box"], 2, f"{w}.box", 2)]
    KernelAbi.from_json(abi)  # the record the loader builds: its own checks (field overruns, sizes by type)


def check(manifest, key: str, raw: bytes | None = None) -> list[str]:
    """Everything wrong with `manifest` as the manifest of entry `key` ([] when sound), the cubin aside.
    `raw`: the bytes it was parsed from (must be its canonical form)."""
    if not isinstance(manifest, dict):
        return ["manifest.json is not a JSON object"]
    m = manifest
    problems = []
    fmt = m.get("format")
    if type(fmt) is not int or fmt != CACHE_FORMAT:
        problems.append(f"manifest format {str(fmt)[:20]!r} is not {CACHE_FORMAT} (another musekern version wrote it)")
    if m.get("key") != key:
        problems.append(f"foreign entry: manifest key {str(m.get('key'))[:16]} != {key[:16]}")
    parts = None
    try:
        parts = KeyParts.from_json(m.get("key_parts"))
        if canonical_json(parts.to_json()) != canonical_json(m["key_parts"]):
            problems.append("key_parts are not in their canonical form")
            parts = None
        elif parts.key() != key:
            problems.append("foreign entry: key_parts hash to a different key")
    except (ValueError, TypeError, KeyError, OverflowError) as e:
        problems.append(f"bad key_parts: {str(e)[:160]}")
    if parts is not None:
        for name, want in (("kernel", parts.kernel), ("arch", parts.arch), ("label", parts.label)):
            if m.get(name) != want:
                problems.append(f"manifest {name} {str(m.get(name))[:60]!r} != {want!r} (from key_parts)")
        if not isinstance(m.get("variant"), dict) or canonical_json(m["variant"]) != canonical_json(
                parts.variant_params):
            problems.append("manifest variant differs from key_parts' variant")
    if not isinstance(m.get("symbol"), str) or not _SYMBOL_RE.match(m["symbol"]):
        problems.append(f"manifest symbol {str(m.get('symbol'))[:40]!r} is not a kernel name")
    try:
        check_abi(m.get("abi"))
        if parts is not None and m["abi"]["abi_version"] != parts.abi_version:
            problems.append(f"abi version {m['abi']['abi_version']} != key_parts' {parts.abi_version}")
    except (ValueError, TypeError, KeyError) as e:
        problems.append(f"bad {str(e)[:200]}" if str(e).startswith("abi") else f"bad abi: {str(e)[:200]}")
    if not is_key(m.get("cubin_sha256")):
        problems.append("manifest cubin_sha256 is not a sha256")
    try:
        _int(m.get("cubin_size"), 1, MAX_CUBIN_BYTES, "manifest cubin_size")
    except ValueError as e:
        problems.append(str(e))
    if "built_with" in m and not isinstance(m["built_with"], dict):
        problems.append("manifest built_with is not an object")
    if SIGNATURES in m:
        problems += signature_problems(m[SIGNATURES])
    if parts is not None and not problems:  # what the variant implies about its launch (store/variant_abi.py)
        problems += variant_abi.problems(parts.kernel, parts.variant_params, parts.label, m["abi"], m["symbol"])
    if m.get(DIGEST) != digest_of(m):
        problems.append("manifest.json was changed after it was written (digest mismatch)"
                        if isinstance(m.get(DIGEST), str) else "manifest.json has no digest")
    elif raw is not None and raw != manifest_bytes(m):
        problems.append("manifest.json is not byte for byte what was written (edited?)")
    return problems


def cubin_problems(manifest: dict, cubin: bytes | None) -> list[str]:
    """What is wrong with `cubin` as the cubin of a manifest that passed `check`."""
    if cubin is None:
        return ["kernel.cubin missing"]
    size, sha = manifest["cubin_size"], manifest["cubin_sha256"]
    if len(cubin) != size:
        return [f"kernel.cubin is {len(cubin)} bytes, manifest says {size}" + (" (truncated)" if len(cubin) < size
                                                                              else "")]
    if sha256_hex(cubin) != sha:
        return ["kernel.cubin sha256 does not match the manifest (corrupted)"]
    from .elf import abi_problems

    return arch_problems(cubin, manifest["arch"]) + abi_problems(cubin, manifest["symbol"], manifest["abi"])


def arch_problems(cubin: bytes, arch: str) -> list[str]:
    """A CUDA ELF built for another arch than the key's (what the loader refuses: an sm_100a cubin under an
    sm_90a key). Bytes that are not a CUDA ELF header are left to the ELF checks and the driver."""
    try:
        got = cubin_arch(cubin)
    except ValueError:
        return []
    if got != arch:
        return [f"kernel.cubin is built for {got}, the entry's arch is {str(arch)[:20]} (another arch's build)"]
    return []
