"""The GEMM path's y = x @ W^T, in one folder: the cuBLASLt binding (cublaslt.py: ctypes, no torch), the tuning and
the tuned launch (tune.py: torch), the tuning records kept in the cache (records.py: stdlib and the store), and the
FP8 weight's GEMM (fp8.py: torch, on the reference's x quantization and the packer's dequantization).

Importing this package imports none of them: the store's maintenance reads records.py without torch.
"""
