"""The runtime loader's CPU-testable half: parameter packing, lookup, integrity, no cutlass import, and the launch
path with the driver stubbed (binding by name, streams, tensor maps, errors)."""
import ctypes
import importlib.util
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cubin_headers import elf_header

from musekern.kernels import declared_abi
from musekern.kernels.qk_norm.variant import QkNormVariant
from musekern.runtime import ArchMismatchError, MissingKernelError, load_artifact
from musekern.runtime.loader import _ParamBlock, prepare_command
from musekern.store.abi import KernelAbi, LaunchSpec, TensorMapSpec, pointer, scalar, tensor, tensormap
from musekern.store.cache import Cache, CorruptEntryError
from musekern.store.keys import key_parts, variant_tag

V = QkNormVariant("bfloat16", 64, True)


def fake_entry(cache, variant=V, arch="sm_90a", cubin=None):
    abi = declared_abi(variant.kernel, variant.params())  # the store refuses any other ABI under the key
    man = {"kernel": variant.kernel, "label": variant.label, "variant": variant.params(),
           "symbol": f"kern_{variant_tag(variant.kernel, variant.params())}",
           "arch": arch, "abi": abi.to_json(), "built_with": {}}
    return cache.put(key_parts(variant, arch, "4.8.1"), elf_header(arch) if cubin is None else cubin, man)


def test_one_block_packs_scalars_pointer_struct_and_tensormap():
    params = [pointer("x"), scalar("m", "i32"), scalar("eps", "f32"),
              tensor("y", shape=("M", "N"), stride=("ld",), stride_type="i32"), tensormap("tma"), scalar("b", "u8")]
    blk = _ParamBlock(params, (TensorMapSpec("tma", "weight", "bf16", (64, 64)),))
    args = {"x": 0xDEAD_BEEF_0000, "m": -3, "eps": 0.5, "y": 0x1000, "M": 7, "N": 64, "ld": 80, "weight": "W",
            "b": 255}
    values = blk.values(args)
    assert blk.tmaps == [(values.index("W"), blk.tmaps[0][1])]  # the tensor, to be encoded by the loader
    values[blk.tmaps[0][0]] = bytes(range(128))
    blk.struct.pack_into(blk.view, 0, *values)
    mem = bytes(blk.view)
    ptrs = [p - blk.base for p in blk.pointers]
    assert [o % (64 if i == 4 else 8) for i, o in enumerate(ptrs)] == [0] * 6  # aligned parameter slots
    assert struct.unpack_from("<Q", mem, ptrs[0]) == (0xDEAD_BEEF_0000,)
    assert struct.unpack_from("<i", mem, ptrs[1]) == (-3,)
    assert struct.unpack_from("<f", mem, ptrs[2]) == (0.5,)
    assert struct.unpack_from("<Qiii", mem, ptrs[3]) == (0x1000, 7, 64, 80)
    assert mem[ptrs[4]:ptrs[4] + 128] == bytes(range(128))
    assert mem[ptrs[5]] == 255
    with pytest.raises(KeyError):
        blk.values({"x": 1})


def test_missing_entry_names_variant_and_command(tmp_path):
    cache = Cache(tmp_path / "c")
    with pytest.raises(MissingKernelError) as ei:
        load_artifact(V, "sm_90a", cache)
    msg = str(ei.value)
    assert V.label in msg and "musekern prepare --target h100 --variant" in msg and str(cache.root) in msg


def test_missing_entry_says_which_part_differs(tmp_path):
    cache = Cache(tmp_path / "c")
    fake_entry(cache, variant=QkNormVariant("bfloat16", 64, False))
    with pytest.raises(MissingKernelError, match="differs in: variant"):
        load_artifact(V, "sm_90a", cache)


def test_prepare_command_round_trips(tmp_path):
    cmd = prepare_command(V, "sm_100a", Cache(tmp_path))
    assert cmd.startswith("musekern prepare --target b200 --variant 'qk_norm[") and str(tmp_path) in cmd


def test_load_verifies_and_refuses_flipped_byte(tmp_path):
    cache = Cache(tmp_path / "c")
    e = fake_entry(cache)
    entry, cubin = load_artifact(V, "sm_90a", cache)
    assert cubin == elf_header() and entry.key == e.key
    path = e.path / "kernel.cubin"
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEntryError, match="verify --repair"):
        load_artifact(V, "sm_90a", cache)


def test_other_arch_is_refused(tmp_path):
    cache = Cache(tmp_path / "c")
    fake_entry(cache, arch="sm_100a")  # an sm_100a build is not taken for an sm_90a device
    with pytest.raises(MissingKernelError, match="differs in: arch"):
        load_artifact(V, "sm_90a", cache)
    # an entry whose cubin's ELF header says another SM than its key: the store does not commit it, and one
    # planted anyway (re-sealed around the other cubin) is corrupt to Cache.load: never loaded (verify says so too)
    cache2 = Cache(tmp_path / "d")
    with pytest.raises(ValueError, match="built for sm_90, the entry's arch is sm_90a"):
        fake_entry(cache2, arch="sm_90a", cubin=elf_header("sm_90"))
    from musekern.store.keys import sha256_hex
    from musekern.store.manifest import manifest_bytes, seal

    e, other = fake_entry(cache2), elf_header("sm_90")
    for name, data in (("kernel.cubin", other), ("manifest.json", manifest_bytes(seal(
            {**e.manifest, "cubin_sha256": sha256_hex(other), "cubin_size": len(other)})))):
        os.chmod(e.path / name, 0o644)
        (e.path / name).write_bytes(data)
    with pytest.raises(CorruptEntryError, match="built for sm_90, the entry's arch is sm_90a"):
        load_artifact(V, "sm_90a", cache2)
    cache3 = Cache(tmp_path / "e")
    fake_entry(cache3, cubin=b"not an elf")
    with pytest.raises(ArchMismatchError, match="not a cubin"):
        load_artifact(V, "sm_90a", cache3)


def test_runtime_matches_any_dsl_version_without_cutlass(tmp_path, monkeypatch):
    """A serving image has no nvidia-cutlass-dsl: entries of any DSL version are used."""
    cache = Cache(tmp_path / "c")
    e = fake_entry(cache)
    monkeypatch.setattr("musekern.runtime.loader.dsl_version", lambda: None)
    assert load_artifact(V, "sm_90a", cache)[0].key == e.key


def test_launch_path_never_imports_the_builder_the_planner_or_cutlass(tmp_path):
    """Ops, loader and lookup in a fresh process: neither musekern.builder nor musekern.plan nor cutlass may be in
    sys.modules afterwards (so no kernel.py either: each imports cutlass; the ops take the pure variant modules; only
    the autobuild hook imports the builder)."""
    cache = Cache(tmp_path / "c")
    fake_entry(cache)
    code = textwrap.dedent(f"""
        import sys, json
        import musekern, musekern.runtime, musekern.ops, musekern.ops.qk_norm, musekern.ops.qkv_front
        from musekern.runtime import load_artifact
        from musekern.store.cache import Cache
        from musekern.kernels.qk_norm.variant import QkNormVariant
        import torch
        entry, cubin = load_artifact(QkNormVariant("bfloat16", 64, True), "sm_90a", Cache({str(cache.root)!r}))
        try:
            musekern.qk_norm(torch.randn(2, 128).to(torch.bfloat16), 64)
        except ValueError as e:
            assert "CUDA device" in str(e)
        try:
            import musekern.ops.qkv_front
        except ImportError:
            pass
        bad = ("cutlass", "musekern.builder", "musekern.plan")
        print(json.dumps(sorted(m for m in sys.modules if m == bad[0] or m.startswith(bad))))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs the build extra (nvidia-cutlass-dsl)")
def test_autobuild_builds_a_missing_variant_on_the_spot(tmp_path, monkeypatch):
    """MUSEKERN_AUTOBUILD=1 with the DSL installed: a miss is compiled into the cache instead of raising."""
    cache = Cache(tmp_path / "c")
    with pytest.raises(MissingKernelError):
        load_artifact(V, "sm_90a", cache)
    monkeypatch.setenv("MUSEKERN_AUTOBUILD", "1")
    from musekern.ops.checks import on_miss

    entry, cubin = load_artifact(V, "sm_90a", cache, on_miss())
    assert entry.manifest["label"] == V.label and cubin[:4] == b"\x7fELF"
    assert [e.key for e in cache.entries()] == [entry.key]


def test_ctypes_launch_is_optional(monkeypatch):
    """The ctypes cuLaunchKernelEx is used when libcuda has it; MUSEKERN_CTYPES_LAUNCH=0 (or no libcuda, as on
    this CPU machine) falls back to cuda.bindings' wrapper, never to an error."""
    import ctypes.util

    from musekern.runtime import driver

    driver.c_launch_kernel_ex.cache_clear()
    monkeypatch.setenv("MUSEKERN_CTYPES_LAUNCH", "0")
    assert driver.c_launch_kernel_ex() is None
    driver.c_launch_kernel_ex.cache_clear()
    monkeypatch.delenv("MUSEKERN_CTYPES_LAUNCH")
    fn = driver.c_launch_kernel_ex()
    driver.c_launch_kernel_ex.cache_clear()
    if ctypes.util.find_library("cuda") is None:
        assert fn is None
    else:
        assert fn.restype is ctypes.c_int and len(fn.argtypes) == 4


def test_launch_config_c_layout():
    """The C struct behind CUlaunchConfig.getPtr() (what the ctypes launch passes): dims, smem, attributes."""
    import ctypes

    from musekern.runtime.driver import launch_config

    class Cfg(ctypes.Structure):
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]

    cfg = launch_config((68, 1, 1), (192, 1, 1), 91136, 0, (2, 1, 1), True)
    c = Cfg.from_address(cfg.getPtr())
    assert (tuple(c.grid), tuple(c.block), c.smem, c.num_attrs) == ((68, 1, 1), (192, 1, 1), 91136, 2)
    first = (ctypes.c_uint * 4).from_address(c.attrs)  # CUlaunchAttribute: id, pad, value union
    assert tuple(first) == (4, 0, 2, 1)  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4, cluster (2, 1, ...)


@pytest.mark.parametrize("dsl", ["4.8.1", None])
def test_a_truncated_manifest_is_reported_corrupt_not_missing(tmp_path, monkeypatch, dsl):
    """Exact key (DSL installed) or any DSL version's build (a serving image): a half-written manifest is
    named as a corrupt entry with its fix, not 'no cached kernel'."""
    cache = Cache(tmp_path / "c")
    e = fake_entry(cache)
    monkeypatch.setattr("musekern.runtime.loader.dsl_version", lambda: dsl)
    os.chmod(e.manifest_path, 0o644)
    e.manifest_path.write_bytes(e.manifest_path.read_bytes()[:100])
    with pytest.raises(CorruptEntryError, match="verify --repair"):
        load_artifact(V, "sm_90a", cache)


# ---------------------------------------------------------------- launch path (the driver stubbed, bench/host_cpu.py)
_hs = importlib.util.spec_from_file_location("host_cpu", Path(__file__).resolve().parents[1] / "bench" / "host_cpu.py")
host_cpu = importlib.util.module_from_spec(_hs)
_hs.loader.exec_module(host_cpu)


class _Cfg(ctypes.Structure):  # CUlaunchConfig's C layout (test_launch_config_c_layout)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@pytest.fixture
def stub_driver():
    """A loaded kernel of a small ABI (pointer, i32, tensor map, f32; cluster 2, PDL) on the stubbed driver; each
    launch records (grid, stream, attributes, the parameter block's bytes per parameter); each encode its key."""
    pytest.importorskip("torch")
    launches, encodes = [], []
    box = {}

    def launch(cfg, func, params, extra):
        c = _Cfg.from_address(cfg)
        blk = box["k"]._block
        sizes = [p.size for p in box["k"].abi.params]
        launches.append({"grid": tuple(c.grid), "stream": c.stream or 0, "num_attrs": c.num_attrs,
                         "params": [ctypes.string_at(a, n) for a, n in zip(blk.pointers, sizes, strict=True)]})
        return box.get("err", 0)

    def encode(spec, ptr, rows, cols, stride, kernel):
        encodes.append((ptr, rows, cols, stride))
        return struct.pack("<QQQQ", ptr, rows, cols, stride) * 4  # 128 bytes that say which map they are

    fake = host_cpu.fake_gpu(launch=launch, encode=encode)
    try:
        abi = KernelAbi((pointer("x"), scalar("m", "i32"), tensormap("tma"), scalar("eps", "f32")),
                        LaunchSpec((128, 1, 1), (2, 1, 1), 0, True), (TensorMapSpec("tma", "w", "bf16", (64, 64)),))
        box["k"] = host_cpu.loaded_kernel("stub[k]", abi)
        yield box, launches, encodes
    finally:
        fake.undo()


def test_launcher_binds_by_name_and_packs_on_the_current_stream(stub_driver):
    from musekern.ops._bind import take

    box, launches, encodes = stub_driver
    k = box["k"]
    assert k.param_names == ("x", "m", "w", "eps")
    names = ("eps", "w", "x", "m")  # an op's own order
    run = k.launcher((4,), take=take(k.label, k.param_names, names))
    run([0.5, (0x1000, 8, 64, 64), 0xDEAD_0000, 7])  # stream: torch's current (stubbed: handle 0)
    run([0.5, (0x1000, 8, 64, 64), 0xDEAD_0000, 8], stream=5)
    assert [(r["grid"], r["stream"], r["num_attrs"]) for r in launches] == [((4, 1, 1), 0, 2), ((4, 1, 1), 5, 2)]
    first = launches[0]["params"]
    assert struct.unpack("<Q", first[0]) == (0xDEAD_0000,) and struct.unpack("<i", first[1]) == (7,)
    assert first[2] == struct.pack("<QQQQ", 0x1000, 8, 64, 64) * 4 and struct.unpack("<f", first[3]) == (0.5,)
    assert struct.unpack("<i", launches[1]["params"][1]) == (8,) and encodes == [(0x1000, 8, 64, 64)]


def test_tensor_maps_encode_once_per_buffer_and_a_new_pointer_re_encodes(stub_driver):
    import torch

    box, launches, encodes = stub_driver
    k = box["k"]
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    key = (w.data_ptr(), 8, 64, 64)
    run = k.launcher((1, 1, 1))
    run([1, 2, key, 0.0])
    run([1, 2, w, 0.0])  # the tensor: the same key read from it, the same map
    assert encodes == [key] and launches[1]["params"][2] == launches[0]["params"][2]
    w2 = torch.zeros(8, 64, dtype=torch.bfloat16)
    run([1, 2, w2, 0.0])  # another buffer: its own map in the parameter
    assert encodes == [key, (w2.data_ptr(), 8, 64, 64)] and launches[2]["params"][2][:8] == struct.pack(
        "<Q", w2.data_ptr())
    with pytest.raises(ValueError, match=r"stub\[k\]: tensor map for 'w' needs a 2-D row-major tensor"):
        run([1, 2, w.t(), 0.0])


def test_tensor_maps_are_bounded_oldest_first(stub_driver):
    from musekern.runtime.tensormap import TensorMaps

    _, _, encodes = stub_driver
    maps = TensorMaps(TensorMapSpec("tma", "w", "bf16", (64, 64)), "stub", max_entries=2)
    for ptr in (0x100, 0x200, 0x300, 0x200, 0x100):
        maps.encode((ptr, 1, 64, 64))
    assert [e[0] for e in encodes] == [0x100, 0x200, 0x300, 0x100] and list(maps.maps) == [
        (0x300, 1, 64, 64), (0x100, 1, 64, 64)]


def test_launch_errors_name_the_kernel(stub_driver):
    from musekern.runtime import CudaError

    box, _, _ = stub_driver
    k = box["k"]
    with pytest.raises(TypeError, match=r"stub\[k\]: bad launch argument"):
        k.launch_ordered((1,), [1, "two", (0x100, 1, 64, 64), 0.0])
    box["err"] = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match=r"stub\[k\]: cuLaunchKernelEx\(grid=\(1, 1, 1\), block=\(128, 1, 1\), "
                                        r"cluster=\(2, 1, 1\)"):
        k.launch((1,), {"x": 1, "m": 2, "w": (0x100, 1, 64, 64), "eps": 0.0})


def test_launch_ordered_keeps_one_launcher_per_grid(stub_driver):
    box, launches, _ = stub_driver
    k = box["k"]
    for g in ((1,), (1,), (2,)):
        k.launch_ordered(g, [1, 2, (0x100, 1, 64, 64), 0.0])
    k.launch_ordered((2,), [1, 2, (0x100, 1, 64, 64), 0.0], pdl=False)  # PDL off: the cluster attribute only
    assert list(k._launchers) == [((1,), None), ((2,), None), ((2,), False)]
    assert [(r["grid"][0], r["num_attrs"]) for r in launches] == [(1, 2), (1, 2), (2, 2), (2, 1)]
