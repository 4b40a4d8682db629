"""The kernels, one folder each (musekern/kernels/base.py says what a folder holds). Importing this package, a
kernel's package, its variant.py or its abi.py never imports cutlass; only a kernel.py does."""
