"""The paged K/V cache layouts serving engines use, poisoned with a sentinel, for the epilogue tests."""
import torch

SENTINEL_BYTE = 0xA5  # what an FP8 cache holds where nothing was written (an e4m3 value: -0.078125)
FP8_CACHES = (torch.float8_e4m3fn, torch.uint8)  # the FP8 caches' two dtypes (uint8: e4m3 bytes, as vLLM allocates)
CACHE_DTYPES = (torch.bfloat16, *FP8_CACHES)


def paged_caches(num_blocks: int, block_size: int, nkv: int, layout: str, fill: float = -7.0, device="cpu",
                 dtype=torch.bfloat16):
    """(key_cache, value_cache, backing): [num_blocks, block_size, nkv, 64] views of one allocation of `dtype`
    (bf16 filled with `fill`; an FP8 cache, float8_e4m3fn or uint8, with SENTINEL_BYTE). "vllm": [2, blocks, ...]
    (each cache contiguous); "flashinfer": NHD [blocks, 2, ...] (block stride twice a block)."""
    shape = (num_blocks, block_size, nkv, 64)
    fp8 = dtype in FP8_CACHES
    store, value = (torch.uint8, SENTINEL_BYTE) if fp8 else (dtype, fill)
    if layout == "vllm":
        kv = torch.full((2, *shape), value, dtype=store, device=device).view(dtype)
        return kv[0], kv[1], kv
    if layout == "flashinfer":
        kv = torch.full((num_blocks, 2, *shape[1:]), value, dtype=store, device=device).view(dtype)
        return kv[:, 0], kv[:, 1], kv
    raise ValueError(layout)


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache's raw bytes (an FP8 cache as uint8, a bf16 one as int16 bits): compared with torch.equal."""
    return cache.view(torch.uint8) if cache.dtype in FP8_CACHES else cache.view(torch.int16)
