"""``row_topk``: the indexer's length-aware top-k, on the best provider for the device.

One entry point so the attention code names no provider: compiled Triton on CUDA
(work per row proportional to its length), the exact torch reference elsewhere.
Both return the same ``int32 [rows, k]`` bit for bit (see ``topk_ref`` for the rules:
positions ascending, ``-1`` padding, ties to the lowest position, NaN never chosen),
positions or, given a slot table, the physical slots they map to.
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import triton_available
from backends.nsa.topk_ref import (
    check_row_topk,
    check_slot_map,
    map_positions_to_slots,
    reference_row_topk,
)
from backends.nsa.topk_triton import row_topk_triton

__all__ = ["row_topk", "row_topk_provider"]


def row_topk_provider(device: torch.device) -> str:
    """``"triton"`` on CUDA with Triton, else ``"torch"``: decided from the device alone,
    so the choice is the same at capture and at replay."""
    device = torch.device(device)
    return "triton" if device.type == "cuda" and triton_available(device) else "torch"


def row_topk(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    next_n: int = 1,
) -> torch.Tensor:
    """Positions of each row's ``k`` best scores in ``[0, lengths[r])`` into ``out``.

    ``logits`` float32 ``[rows, width]`` (row stride may exceed ``width``), ``lengths``
    int32 ``[rows]`` (clamped to ``[0, width]``), ``out`` int32 ``[rows, k]``. No host
    sync on either provider, so it can be captured in a CUDA graph.

    With ``slots`` (int32 ``[reqs, max_len]``, ``rows = reqs * next_n``) ``out`` gets
    ``slots[r // next_n, pos]`` in place of each position ``pos``, ``-1`` kept
    (``topk_ref.map_positions_to_slots``): the decode indexer's answer in one call, so the
    Triton provider can do it in the same launch instead of a chain of small torch ops.
    """
    if row_topk_provider(logits.device) == "triton":
        return row_topk_triton(logits, lengths, k, out, slots=slots, next_n=next_n)
    if slots is None:
        return reference_row_topk(logits, lengths, k, out)
    # Refuse a bad table before ``out`` is written, as the Triton provider does.
    check_row_topk(logits, lengths, k, out)
    check_slot_map(out.shape[0], slots, next_n, logits.device)
    reference_row_topk(logits, lengths, k, out)
    return out.copy_(map_positions_to_slots(out, slots, next_n))
