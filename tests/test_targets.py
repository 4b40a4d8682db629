import pytest

from musekern import targets
from musekern.targets import TARGETS, UnknownTargetError, arch_for_capability, get_target, target_from_device


@pytest.mark.parametrize("name,arch,sms", [("h100", "sm_90a", 132), ("h200", "sm_90a", 132),
                                           ("h100-pcie", "sm_90a", 114), ("h20", "sm_90a", 78),
                                           ("b200", "sm_100a", 148)])
def test_named_targets(name, arch, sms):
    t = get_target(name)
    assert (t.arch, t.sm_count) == (arch, sms)
    assert t.max_smem_optin == 227 * 1024 and t.max_cluster == 8


def test_unknown_target_lists_known():
    with pytest.raises(UnknownTargetError, match="known targets: b200, h100, h100-pcie, h20, h200"):
        get_target("a100x")


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
