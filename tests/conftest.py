"""Suite-wide settings: Triton interpreter and one torch thread on the CPU; GPU tests skip without CUDA."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run under the interpreter. Triton decides at import time
# (its own library functions are jitted then), so this must precede any triton import.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The CPU suite runs tiny tensors on 2 cores: one thread avoids OpenMP spin-waits
# that make small matmuls tens of times slower under contention.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
