"""GPU tests of the torch backend. Skipped, not failed, without torch or without a CUDA device: on such a
machine run them through `benchmarks/gpu_check.sh` on a GPU machine instead.

The skip is applied per test by `pytest_runtest_setup` (a conftest hook of this folder only) rather than by
raising at import, because a skip raised while pytest imports a conftest is reported as a collection error."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # the torch extra is optional
    torch = None

NEEDS_CUDA = "needs CUDA; run benchmarks/gpu_check.sh on a GPU machine"


def cuda_ready() -> bool:
    return torch is not None and torch.cuda.is_available()


def pytest_runtest_setup(item):
    if not cuda_ready():
        pytest.skip(NEEDS_CUDA if torch is not None else f"torch is not installed; {NEEDS_CUDA}")


@pytest.fixture
def cuda():
    return torch.device("cuda")


@pytest.fixture(scope="session")
def chat200(sample_head) -> Path:
    """The first 200 requests of the chat sample: enough requests to fill a small cache and evict from it."""
    return sample_head("chat", 200)
