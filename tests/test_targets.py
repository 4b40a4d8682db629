from pathlib import Path

import pytest

from musekern import targets
from musekern.config import load_config
from musekern.plan import plan_model
from musekern.targets import (
    SUPPORTED_ARCHES,
    TARGETS,
    UnknownTargetError,
    UnsupportedTargetError,
    arch_for_capability,
    get_target,
    target_from_device,
)

PKG = Path(targets.__file__).parent
H200_DEV = ("NVIDIA H200", (9, 0), 132, 232448, 60 << 20)
A100_DEV = ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912, 40 << 20)


@pytest.mark.parametrize("name,arch,sms", [("h100", "sm_90a", 132), ("h200", "sm_90a", 132),
                                           ("h100-pcie", "sm_90a", 114), ("h20", "sm_90a", 78),
                                           ("b200", "sm_100a", 148)])
def test_named_targets(name, arch, sms):
    t = get_target(name)
    assert (t.arch, t.sm_count) == (arch, sms)
    assert t.max_smem_optin == 227 * 1024 and t.max_cluster == 8


def test_unknown_target_lists_known():
    with pytest.raises(UnknownTargetError, match="supported targets: b200, h100, h100-pcie, h20, h200"):
        get_target("a100x")


def test_every_named_target_is_supported():
    assert {t.arch for t in TARGETS.values()} <= set(SUPPORTED_ARCHES)


def test_a_gpu_we_cannot_build_for_is_named_and_refused():
    with pytest.raises(UnsupportedTargetError, match=r"a100 \(sm_80, 108 SMs\) is not supported.*"
                                                     r"supported targets: b200, h100, h100-pcie, h20, h200"):
        get_target("a100")
    a100 = target_from_device(*A100_DEV)
    assert a100.name == "a100" and a100.arch == "sm_80"
    with pytest.raises(UnsupportedTargetError, match="supported targets"):
        plan_model(load_config(), [a100])  # rejected at plan time, before anything compiles


# The fix command of a kernel missing at run time names the GPU it runs on; without one, the first of the arch.
@pytest.mark.parametrize("devices,arch,name", [([H200_DEV], "sm_90a", "h200"),
                                               ([("NVIDIA H20", (9, 0), 78, 232448, 60 << 20)], "sm_90a", "h20"),
                                               ([], "sm_90a", "h100"), ([H200_DEV], "sm_100a", "b200"),
                                               ([], "sm_80", None)])
def test_missing_kernel_hint_names_the_users_target(monkeypatch, tmp_path, devices, arch, name):
    from musekern.kernels.qk_norm.variant import QkNormVariant
    from musekern.runtime.loader import prepare_command
    from musekern.store.cache import Cache

    monkeypatch.setattr(targets, "_driver_devices", lambda: devices)
    assert targets.target_name_for_arch(arch) == name
    cmd = prepare_command(QkNormVariant("bfloat16", 64, False), arch, Cache(tmp_path))
    assert cmd.startswith(f"musekern prepare --target {name} --variant" if name else "musekern prepare --variant")


def test_case_insensitive():
    assert get_target("H200") is TARGETS["h200"]


def test_capability_to_arch():
    assert arch_for_capability(9, 0) == "sm_90a" and arch_for_capability(10, 0) == "sm_100a"
    assert arch_for_capability(8, 0) == "sm_80"


def test_device_maps_to_named_target():
    assert target_from_device("NVIDIA H200", (9, 0), 132, 232448, 60 << 20).name == "h200"
    assert target_from_device("NVIDIA H100 PCIe", (9, 0), 114, 232448, 50 << 20).name == "h100-pcie"
    t = target_from_device("Some GPU", (9, 0), 100, 232448, 50 << 20)
    assert t.name == "local-sm_90a-100sm" and t.sm_count == 100


def test_no_gpu_means_no_local_target(monkeypatch):
    monkeypatch.setattr(targets, "_driver_devices", lambda: [])
    assert targets.local_target() is None
