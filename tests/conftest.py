"""Suite-wide settings: one torch thread, and GPU tests skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

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
