"""Exact semantics of the indexer's length-aware row top-k, as a plain torch reference.

Every provider (``backends.nsa.topk_triton``) must return exactly what
``reference_row_topk`` returns, bit for bit, so the rules live here:

* Row ``r`` owns positions ``[0, L)`` with ``L = clamp(lengths[r], 0, width)``; nothing
  at or past ``L`` is ever read or chosen (deep_gemm leaves those entries undefined).
* ``L <= k``: the row takes every position ``0 .. L-1`` without looking at the scores
  (NaN included): its whole KV fits in the top-k budget.
* ``L > k``: the ``k`` largest scores win, ordered by the float value with ``-0.0`` and
  ``+0.0`` equal and ``-inf`` lowest; ties at the threshold go to the **lowest
  positions**. NaN is never chosen, so a row with fewer than ``k`` non-NaN scores
  takes all of them.
* Output ``int32 [rows, k]``: the chosen positions in **ascending position order**,
  then ``-1`` padding. Sparse attention does not need score order; ascending order
  is what a single compaction pass produces, and it makes outputs comparable
  bit for bit.

The reference sorts the whole width (static shapes, no host sync: usable under CUDA
graphs, just not length-aware); the Triton kernel does work proportional to ``L``.

The decode indexer wants physical KV slots, not positions: ``map_positions_to_slots``
is that mapping as torch ops (row ``r`` reads its request ``r // next_n``'s row of the
slot table), and the exact result the Triton kernel's fused mapping must reproduce.
"""

from __future__ import annotations

import torch

from planner.errors import PlanError

__all__ = [
    "PAD",
    "check_row_topk",
    "check_slot_map",
    "map_positions_to_slots",
    "order_keys",
    "reference_row_topk",
]

PAD = -1  # an output entry that names no position
_SIGN = 1 << 31
_LOW32 = (1 << 32) - 1


def check_row_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Shape, dtype and layout checks shared by every provider, so they are interchangeable.

    Only metadata is read (no host sync); value limits (lengths past the width) are
    defined behaviour (clamped), not errors.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise PlanError(
            "logits must be float32 [rows, width]",
            field="logits",
            expected="float32 [rows, width]",
            actual=f"{logits.dtype} {tuple(logits.shape)}",
        )
    rows, width = logits.shape
    if width > 1 and logits.stride(1) != 1:
        raise PlanError(
            "logits rows must be contiguous (row stride may exceed the width)",
            field="logits",
            expected="stride(1) == 1",
            actual=logits.stride(),
        )
    if lengths.dim() != 1 or lengths.dtype != torch.int32 or lengths.shape[0] != rows:
        raise PlanError(
            "lengths must be int32 [rows]",
            field="lengths",
            expected=f"int32 [{rows}]",
            actual=f"{lengths.dtype} {tuple(lengths.shape)}",
        )
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise PlanError("k must be a positive int", field="k", expected=">= 1", actual=k)
    if out.dtype != torch.int32 or tuple(out.shape) != (rows, k):
        raise PlanError(
            "out must be int32 [rows, k]",
            field="out",
            expected=f"int32 [{rows}, {k}]",
            actual=f"{out.dtype} {tuple(out.shape)}",
        )
    if k > 1 and out.stride(1) != 1:
        raise PlanError(
            "out rows must be contiguous",
            field="out",
            expected="stride(1) == 1",
            actual=out.stride(),
        )
    for name, t in (("lengths", lengths), ("out", out)):
        if t.device != logits.device:
            raise PlanError(
                f"{name} must be on the logits' device",
                field=name,
                expected=str(logits.device),
                actual=str(t.device),
            )


def check_slot_map(rows: int, slots: torch.Tensor, next_n: int, device: torch.device) -> None:
    """Checks for mapping ``rows`` top-k rows through ``slots``, shared by both providers so
    they refuse the same tables. Metadata only (no host sync). A table with no column is
    refused: the reference's clamp would have no column to land on."""
    if not isinstance(next_n, int) or isinstance(next_n, bool) or next_n < 1:
        raise PlanError(
            "next_n must be a positive int", field="next_n", expected=">= 1", actual=next_n
        )
    if rows % next_n != 0:
        raise PlanError(
            "rows must be a multiple of next_n (rows = reqs * next_n)",
            field="next_n",
            expected=f"a divisor of {rows}",
            actual=next_n,
        )
    reqs = rows // next_n
    if slots.dim() != 2 or slots.dtype != torch.int32 or slots.shape[0] != reqs:
        raise PlanError(
            "slots must be int32 [reqs, max_len] with rows = reqs * next_n",
            field="slots",
            expected=f"int32 [{reqs}, max_len]",
            actual=f"{slots.dtype} {tuple(slots.shape)}",
        )
    if slots.shape[1] == 0:
        raise PlanError(
            "slots needs at least one column",
            field="slots",
            expected="max_len >= 1",
            actual=tuple(slots.shape),
        )
    if slots.shape[1] > 1 and slots.stride(1) != 1:
        raise PlanError(
            "slots rows must be contiguous (row stride may exceed the width)",
            field="slots",
            expected="stride(1) == 1",
            actual=slots.stride(),
        )
    if slots.device != device:
        raise PlanError(
            "slots must be on the logits' device",
            field="slots",
            expected=str(device),
            actual=str(slots.device),
        )


def map_positions_to_slots(
    idx: torch.Tensor, token_slots: torch.Tensor, next_n: int
) -> torch.Tensor:
    """``token_slots[r // next_n, idx[r, j]]`` for every chosen position, ``-1`` kept: a new
    ``int32`` tensor shaped like ``idx``.

    Positions are clamped into the table before the gather so ``-1`` (and any position past
    a narrow table) reads a real entry and shapes stay static; ``-1`` is put back after.
    """
    check_slot_map(idx.shape[0], token_slots, next_n, idx.device)
    rows = idx.shape[0]
    req_of_row = torch.arange(rows, device=idx.device) // next_n
    col = idx.clamp(min=0, max=token_slots.shape[1] - 1).long()
    slots = token_slots[req_of_row.unsqueeze(1), col]
    return torch.where(idx >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in ``[0, 2**32)`` that order like the float32 values ``x``.

    The fp32 bit pattern, sign bit flipped for non-negatives and all bits flipped for
    negatives, is the standard order-preserving map; ``-0.0`` is folded into ``+0.0``
    first so equal scores tie. NaN gets some key; callers exclude NaN themselves.
    """
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits + _SIGN, (~bits) & _LOW32)


def reference_row_topk(
    logits: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The module's rules, computed the obvious way over the full width; returns ``out``."""
    rows, width = logits.shape
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=logits.device)
    check_row_topk(logits, lengths, k, out)
    pos = torch.arange(width, device=logits.device)
    length = lengths.to(torch.int64).clamp(0, width).unsqueeze(1)  # [rows, 1]
    in_len = pos < length
    score = torch.where(in_len & ~torch.isnan(logits), order_keys(logits), -1)
    kk = min(k, width)
    # Stable descending sort: among equal keys the lowest position comes first.
    best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :kk]
    chosen = score.gather(1, best) >= 0
    picked = torch.zeros(rows, width, dtype=torch.bool, device=logits.device)
    picked.scatter_(1, best, chosen)
    picked = torch.where(length <= k, in_len, picked)
    # Ascending compaction: unpicked positions sort to the end as ``width``.
    packed = torch.sort(torch.where(picked, pos, width), dim=1).values[:, :kk]
    out[:, :kk] = torch.where(packed < width, packed, PAD).to(torch.int32)
    out[:, kk:] = PAD
    return out
