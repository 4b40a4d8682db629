import pytest

from musekern.store.abi import (
    ABI_VERSION,
    KernelAbi,
    LaunchSpec,
    TensorMapSpec,
    check_abi_against_ptx,
    coord_tensor,
    pointer,
    ptx_entry_params,
    scalar,
    tensor,
    tensormap,
)

# A PTX signature of the shapes NOTES.md §3 documents (pointer, tensormap, coord tensor, struct tensor, scalars).
PTX = """
.visible .entry kern_0(
	.param .u64 .ptr .global .align 16 kern_0_param_0,
	.param .align 64 .b8 kern_0_param_1[128],
	.param .align 4 .b8 kern_0_param_2[4],
	.param .align 8 .b8 kern_0_param_3[24],
	.param .u32 kern_0_param_4,
	.param .f32 kern_0_param_5
)
.maxntid 128, 1, 1
{
}
"""


def make_abi():
    return KernelAbi(
        params=(pointer("x"), tensormap("tma_w"), coord_tensor("w_coord", ("rows",)),
                tensor("y", shape=("M", "N"), stride=("ld",), stride_type="i32"), scalar("m", "i32"),
                scalar("eps", "f32")),
        launch=LaunchSpec(block=(160, 1, 1), cluster=(2, 1, 1), dynamic_smem_bytes=1000, pdl=True, grid="heads*S"),
        tensormaps=(TensorMapSpec("tma_w", "weight", "bf16", (64, 64)),))


def test_tensor_struct_layout_matches_notes():
    # NOTES.md §3: make_layout((M,N), stride=(LD,1)) with Int32 values: ptr +0, M +8, N +12, LD +16, size 24
    p = tensor("y", shape=("M", "N"), stride=("ld",), stride_type="i32")
    assert [(f.name, f.offset, f.size) for f in p.fields] == [("y", 0, 8), ("M", 8, 4), ("N", 12, 4), ("ld", 16, 4)]
    assert (p.align, p.size) == (8, 24)
    # a compact 3-D tensor with i64 strides: A/B/C at +8/+12/+16, strides at +24/+32, size 40
    q = tensor("t", shape=("A", "B", "C"), stride=("s0", "s1"))
    assert [f.offset for f in q.fields] == [0, 8, 12, 16, 24, 32] and q.size == 40


def test_signature_matches_ptx():
    abi = make_abi()
    assert ptx_entry_params(PTX, "kern_0") == [(8, 8), (64, 128), (4, 4), (8, 24), (4, 4), (4, 4)]
    check_abi_against_ptx(abi, PTX, "kern_0")


def test_mismatch_is_reported():
    abi = make_abi()
    bad = KernelAbi(params=abi.params[:-1], launch=abi.launch)
    with pytest.raises(ValueError, match="ABI mismatch"):
        check_abi_against_ptx(bad, PTX, "kern_0")
    with pytest.raises(ValueError, match="not found"):
        check_abi_against_ptx(abi, PTX, "other")


def test_json_round_trip():
    abi = make_abi()
    d = abi.to_json()
    assert d["abi_version"] == ABI_VERSION
    assert KernelAbi.from_json(d) == abi


def test_from_json_rejects_other_abi_version():
    d = make_abi().to_json()
    d["abi_version"] = ABI_VERSION + 1
    with pytest.raises(ValueError, match="rebuild the cache"):
        KernelAbi.from_json(d)
