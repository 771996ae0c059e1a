"""Small int32 tensors for the metadata-kernel tests, on CUDA when there is one."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32


def ints(values, dtype: torch.dtype = I32) -> torch.Tensor:
    """``values`` as a tensor on ``DEVICE`` (int32 unless told)."""
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def garbage(*shape: int) -> torch.Tensor:
    """An output buffer pre-filled with -7, so an element a kernel forgets to write cannot
    pass as a zero."""
    return torch.full(shape, -7, dtype=I32, device=DEVICE)
