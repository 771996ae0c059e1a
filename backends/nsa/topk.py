"""``row_topk``: the indexer's length-aware top-k, on the best provider for the device.

One entry point so the attention code names no provider: compiled Triton on CUDA
(work per row proportional to its length), the exact torch reference elsewhere.
Both return the same ``int32 [rows, k]`` bit for bit (see ``topk_ref`` for the rules:
positions ascending, ``-1`` padding, ties to the lowest position, NaN never chosen).
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import triton_available
from backends.nsa.topk_ref import reference_row_topk
from backends.nsa.topk_triton import row_topk_triton

__all__ = ["row_topk", "row_topk_provider"]


def row_topk_provider(device: torch.device) -> str:
    """``"triton"`` on CUDA with Triton, else ``"torch"``: decided from the device alone,
    so the choice is the same at capture and at replay."""
    device = torch.device(device)
    return "triton" if device.type == "cuda" and triton_available(device) else "torch"


def row_topk(
    logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor
) -> torch.Tensor:
    """Positions of each row's ``k`` best scores in ``[0, lengths[r])`` into ``out``.

    ``logits`` float32 ``[rows, width]`` (row stride may exceed ``width``), ``lengths``
    int32 ``[rows]`` (clamped to ``[0, width]``), ``out`` int32 ``[rows, k]``. No host
    sync on either provider, so it can be captured in a CUDA graph.
    """
    if row_topk_provider(logits.device) == "triton":
        return row_topk_triton(logits, lengths, k, out)
    return reference_row_topk(logits, lengths, k, out)
