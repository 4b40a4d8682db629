"""Shared test set-up: `gpu` tests run only where torch sees a CUDA device (the H200 round)."""
import os

import pytest


def _have_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAVE_GPU = _have_gpu()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_cache_dir():
    """The prepared cache the GPU tests load from (carried to the GPU machine)."""
    d = os.environ.get("MUSEKERN_CACHE_DIR")
    if not d or not os.path.isdir(d):
        pytest.skip("MUSEKERN_CACHE_DIR must point at a prepared cache (see bench/gpu_round.sh)")
    return d
