"""Sylvester-ordered Hadamard rotation used by the lightning indexer.

Rotating queries and keys by the same orthogonal matrix leaves their dot
products unchanged but spreads outliers over all coordinates, so per-vector
fp8 scales waste less range. The order (Sylvester) matters: keys cached by
one implementation are scored against queries rotated by another.
"""

from __future__ import annotations

import torch

from dsv32_engine.models.layers.exact import accumulate_dtype


def hadamard_matrix(
    n: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix ``H_n`` (entries +-1); ``n`` a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of 2, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_rotate(x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ H^T * n^-0.5`` over the last dim, in fp32 (orthonormal, so norms are kept).

    Accumulated in float64 on the CPU, so a row's result does not depend on the batch.

    Pass ``h`` (from ``hadamard_matrix``) to avoid rebuilding it every call.
    """
    n = x.shape[-1]
    if h is None:
        h = hadamard_matrix(n, device=x.device)
    acc = accumulate_dtype(x)
    return ((x.to(acc) @ h.to(acc).t()) * (n**-0.5)).float()
