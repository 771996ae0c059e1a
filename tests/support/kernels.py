"""Small int32 tensors for the metadata-kernel tests, on CUDA when there is one."""

from __future__ import annotations

import pytest
import torch

from backends.common import triton_kernels as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32

interpretable_stdlib = pytest.mark.skipif(
    tk.triton is not None and tk._interpreting() and not tk._stdlib_interpretable(),
    reason="triton.language was imported before TRITON_INTERPRET=1: its library functions "
    "(tl.cumsum, tl.sort, ...) cannot be interpreted",
)
"""Beside ``pytest.mark.triton``, for the kernels that call Triton's library functions: the
interpreter runs them only when TRITON_INTERPRET was set before ``triton.language`` was first
imported (conftest sets it first; a plugin importing triton earlier would freeze them)."""


def ints(values, dtype: torch.dtype = I32) -> torch.Tensor:
    """``values`` as a tensor on ``DEVICE`` (int32 unless told)."""
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def garbage(*shape: int) -> torch.Tensor:
    """An output buffer pre-filled with -7, so an element a kernel forgets to write cannot
    pass as a zero."""
    return torch.full(shape, -7, dtype=I32, device=DEVICE)
