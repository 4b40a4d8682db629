"""The paged K/V cache layouts serving engines use, poisoned with a sentinel, for the epilogue tests."""
import torch


def paged_caches(num_blocks: int, block_size: int, nkv: int, layout: str, fill: float = -7.0, device="cpu"):
    """(key_cache, value_cache, backing): bf16 [num_blocks, block_size, nkv, 64] views of one allocation. "vllm":
    [2, blocks, ...] (each cache contiguous); "flashinfer": NHD [blocks, 2, ...] (block stride twice a block)."""
    shape = (num_blocks, block_size, nkv, 64)
    if layout == "vllm":
        kv = torch.full((2, *shape), fill, dtype=torch.bfloat16, device=device)
        return kv[0], kv[1], kv
    if layout == "flashinfer":
        kv = torch.full((num_blocks, 2, *shape[1:]), fill, dtype=torch.bfloat16, device=device)
        return kv[:, 0], kv[:, 1], kv
    raise ValueError(layout)
