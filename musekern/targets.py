"""GPU targets: what the planner needs to know about a GPU, with no GPU present.

`get_target(name)` for a named target; `local_target()` reads the local device through
the CUDA driver (cuda.bindings) when there is one and returns None otherwise.

`TARGETS` are the GPUs musekern builds for: every one has an arch in `SUPPORTED_ARCHES`, the one list of
the arches every kernel of the plan compiles for (the builder refuses any other). `OTHER_DEVICES` are GPUs we can
name but not build for: asking for one (or running on one) is an error that lists the supported targets.
"""
from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
# Hopper / Blackwell hardware limits (CUDA programming guide, compute capability tables).
SM90_MAX_SMEM_OPTIN = 227 * KIB  # 232448: max dynamic shared memory per block (opt-in)
SM100_MAX_SMEM_OPTIN = 227 * KIB
PORTABLE_MAX_CLUSTER = 8  # without CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
SM90_MAX_CLUSTER = 16  # non-portable maximum on sm_90
MAX_THREADS_PER_BLOCK = 1024
SM90_SMEM_PER_SM = 228 * KIB  # shared memory of one SM, shared by its resident CTAs
SM90_REGS_PER_SM = 64 * 1024  # 32-bit registers of one SM, shared by its resident CTAs
SMEM_RESERVED_PER_CTA = 1 * KIB  # the driver keeps 1 KiB of each CTA's shared memory for itself


@dataclass(frozen=True)
class Target:
    name: str
    arch: str  # the --gpu-arch the cubin is compiled for
    sm_count: int
    max_smem_optin: int  # bytes of dynamic shared memory a block may opt into
    max_cluster: int  # largest cluster size the planner may use (portable limit)
    l2_bytes: int
    capability: tuple[int, int]
    smem_per_sm: int = SM90_SMEM_PER_SM

    @property
    def description(self) -> str:
        return f"{self.name} ({self.arch}, {self.sm_count} SMs)"


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("h100", "sm_90a", 132, SM90_MAX_SMEM_OPTIN, PORTABLE_MAX_CLUSTER, 50 * 1024 * KIB, (9, 0)),
        Target("h200", "sm_90a", 132, SM90_MAX_SMEM_OPTIN, PORTABLE_MAX_CLUSTER, 60 * 1024 * KIB, (9, 0)),
        Target("h100-pcie", "sm_90a", 114, SM90_MAX_SMEM_OPTIN, PORTABLE_MAX_CLUSTER, 50 * 1024 * KIB, (9, 0)),
        Target("h20", "sm_90a", 78, SM90_MAX_SMEM_OPTIN, PORTABLE_MAX_CLUSTER, 60 * 1024 * KIB, (9, 0)),
        Target("b200", "sm_100a", 148, SM100_MAX_SMEM_OPTIN, PORTABLE_MAX_CLUSTER, 126 * 1024 * KIB, (10, 0)),
    )
}
ARCHES = tuple(sorted({t.arch for t in TARGETS.values()}))
# The arches every kernel of the plan builds for (the only list): qkv_front needs sm_90-class TMA, clusters and
# st.async, qkv_epilogue griddepcontrol (qk_norm would build for more). sm_100a compiles and is checked on CPU only.
SUPPORTED_ARCHES = ("sm_90a", "sm_100a")
# GPUs with a name but no kernel build: named so that `--target a100` or a local A100 gets a clear refusal.
OTHER_DEVICES: dict[str, Target] = {
    t.name: t
    for t in (
        Target("a100", "sm_80", 108, 163 * KIB, 1, 40 * 1024 * KIB, (8, 0), smem_per_sm=164 * KIB),
    )
}


class TargetError(ValueError):
    """A target that cannot be planned for; the message lists the supported targets."""


class UnknownTargetError(TargetError):
    pass


class UnsupportedTargetError(TargetError):
    pass


def supported_targets() -> str:
    """'b200, h100, h100-pcie, h20, h200': the names `--target` and a config's `targets` accept."""
    return ", ".join(sorted(TARGETS))


def unsupported_reason(t: Target) -> str | None:
    """Why musekern cannot build for `t`, or None when it can."""
    if t.arch in SUPPORTED_ARCHES:
        return None
    return (f"{t.description} is not supported: musekern's kernels build for {' and '.join(SUPPORTED_ARCHES)} "
            f"only (qkv_front needs sm_90-class TMA, clusters and st.async); supported targets: "
            f"{supported_targets()}")


def check_supported(t: Target) -> Target:
    """`t`, or UnsupportedTargetError naming the supported targets (the planner calls this)."""
    reason = unsupported_reason(t)
    if reason:
        raise UnsupportedTargetError(reason)
    return t


def get_target(name: str) -> Target:
    """The named target; UnsupportedTargetError for a GPU we know but cannot build for, UnknownTargetError
    for a name we do not know. Both messages list the supported targets."""
    key = name.strip().lower()
    if key in TARGETS:
        return TARGETS[key]
    if key in OTHER_DEVICES:
        return check_supported(OTHER_DEVICES[key])
    raise UnknownTargetError(f"unknown GPU target {name!r}; supported targets: {supported_targets()}")


def arch_for_capability(major: int, minor: int) -> str:
    """The arch musekern compiles for a device of this compute capability ('a' = arch-specific features)."""
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def _driver_devices():
    """[(name, (major, minor), sm_count, smem_optin, l2_bytes)] of local CUDA devices, [] without a driver/GPU."""
    try:
        from cuda.bindings import driver as drv
    except Exception:
        return []
    ok = drv.CUresult.CUDA_SUCCESS
    try:
        if drv.cuInit(0)[0] != ok:
            return []
    except Exception:  # newer cuda.bindings raise when libcuda itself is missing (no driver installed)
        return []
    err, n = drv.cuDeviceGetCount()
    if err != ok:
        return []
    A = drv.CUdevice_attribute
    out = []
    for i in range(n):
        err, dev = drv.cuDeviceGet(i)
        if err != ok:
            continue
        name = drv.cuDeviceGetName(256, dev)[1].split(b"\0", 1)[0].decode()
        get = lambda a, dev=dev: drv.cuDeviceGetAttribute(a, dev)[1]  # noqa: E731
        out.append((name, (get(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                           get(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
                    get(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                    get(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
                    get(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)))
    return out


def target_from_device(name: str, cap: tuple[int, int], sm_count: int, smem_optin: int, l2: int) -> Target:
    """Map a device to a named target when one matches (same arch and SM count), else an ad-hoc one.

    The result may be unsupported (an A100): callers that plan check it (`check_supported`)."""
    arch = arch_for_capability(*cap)
    lname = name.lower()
    known = [*TARGETS.values(), *OTHER_DEVICES.values()]
    for t in known:
        if t.arch == arch and t.sm_count == sm_count and t.name.split("-")[0] in lname:
            return t
    for t in known:
        if t.arch == arch and t.sm_count == sm_count:
            return t
    return Target(f"local-{arch}-{sm_count}sm", arch, sm_count, smem_optin, PORTABLE_MAX_CLUSTER, l2, cap)


def local_target(device_index: int = 0) -> Target | None:
    devs = _driver_devices()
    if len(devs) <= device_index:
        return None
    return target_from_device(*devs[device_index])


def target_name_for_arch(arch: str) -> str | None:
    """The target to name in a fix command for a kernel missing on `arch`: the local GPU's when it has
    that arch (an H200 user is told `--target h200`), else the first named target of the arch, else None."""
    local = local_target()
    if local is not None and local.arch == arch and local.name in TARGETS:
        return local.name
    return next((t.name for t in TARGETS.values() if t.arch == arch), None)
