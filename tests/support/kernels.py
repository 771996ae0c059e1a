"""Small int32 tensors for the metadata-kernel tests, on CUDA when there is one."""

from __future__ import annotations

import importlib.util

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (a GPU and the dev extra have it; the main job does not)",
)
"""Tests of Triton kernels (run by Triton's interpreter on the CPU)."""


def ints(values, dtype: torch.dtype = I32) -> torch.Tensor:
    """``values`` as a tensor on ``DEVICE`` (int32 unless told)."""
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def garbage(*shape: int) -> torch.Tensor:
    """An output buffer pre-filled with -7, so an element a kernel forgets to write cannot
    pass as a zero."""
    return torch.full(shape, -7, dtype=I32, device=DEVICE)
