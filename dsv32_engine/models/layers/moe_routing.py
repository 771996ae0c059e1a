"""Token-to-expert dispatch for the routed MoE: sort pairs by expert, run, combine.

Each token picks ``top_k`` experts, giving ``P = rows * top_k`` (token, expert) pairs.
They are stable-sorted by expert id, so each expert's pairs form one contiguous range
(ends found with ``searchsorted`` on the sorted ids, rather than ``bincount``, which
reads its maximum back to the host on CUDA). The grouped GEMMs run on those ranges, and
the results are put back in pair order and summed per token over its ``top_k`` slots.
Every shape is ``P`` or ``rows`` and no value is read back, so the whole path can be
captured in a CUDA graph. The combine is deterministic: no atomics, a fixed sum order.

On CUDA, for decode-sized batches (``KERNEL_PAIRS``), the sort and its bookkeeping are one
launch (``moe_dispatch_triton``) instead of about ten small kernels, same outputs bit for
bit; the CPU and larger batches keep the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv32_engine.models.layers import moe_dispatch_triton
from dsv32_engine.models.layers.exact import forward_takes_kernel, invariant
from dsv32_engine.models.layers.grouped_gemm import grouped_mm
from dsv32_engine.models.layers.grouped_gemm_triton import INVARIANT_TILE_ROWS
from dsv32_engine.models.layers.swiglu_triton import silu_mul

__all__ = [
    "ExpertBatch",
    "combine",
    "dispatch_takes_kernel",
    "routed_experts",
    "sort_by_expert",
    "sort_by_expert_torch",
]


@dataclass(frozen=True)
class ExpertBatch:
    """The pairs in expert order: which pair, which token row, its weight, group ends."""

    order: torch.Tensor  # [P] int64: pair id (row * top_k + slot), sorted by expert, stable
    rows: torch.Tensor  # [P] int64: the token row of each sorted pair
    weights: torch.Tensor  # [P] fp32: routing weight of each sorted pair
    ends: torch.Tensor  # [E] int32: one past the last sorted pair of each expert


KERNEL_PAIRS = 1024
"""Most (token, expert) pairs ``sort_by_expert`` hands the kernel: 128 decode rows of top-8,
the sizes a captured graph holds, where its launches are the cost. Larger (prefill)
batches are eager and take the torch path, whose ten launches are small beside their
GEMMs; the kernel's wider sorts (to ``MAX_PAIRS``) are checked under the interpreter but
had not run on a GPU when this limit was set (docs/verification.md, round 6)."""


def dispatch_takes_kernel(weights: torch.Tensor, indices: torch.Tensor, n_experts: int) -> bool:
    """Whether ``sort_by_expert`` runs the one-launch kernel: CUDA, Triton, at most
    ``KERNEL_PAIRS`` pairs (decided from shapes, so capture and replay agree) and no
    autograd through the weights (the kernel records no backward)."""
    return (
        0 < indices.numel() <= KERNEL_PAIRS
        and 0 < n_experts <= moe_dispatch_triton.MAX_EXPERTS
        and forward_takes_kernel(indices, weights)
    )


def sort_by_expert(weights: torch.Tensor, indices: torch.Tensor, n_experts: int) -> ExpertBatch:
    """Group the ``[rows, top_k]`` routing choices by expert, with static shapes."""
    if dispatch_takes_kernel(weights, indices, n_experts):
        order, rows, sorted_weights, ends = moe_dispatch_triton.sort_by_expert_triton(
            weights, indices, n_experts
        )
        return ExpertBatch(order=order, rows=rows, weights=sorted_weights, ends=ends)
    return sort_by_expert_torch(weights, indices, n_experts)


def sort_by_expert_torch(
    weights: torch.Tensor, indices: torch.Tensor, n_experts: int
) -> ExpertBatch:
    """The torch formulation: the CPU's path, and the kernel's reference."""
    top_k = indices.shape[1]
    expert, order = torch.sort(indices.reshape(-1), stable=True)
    ids = torch.arange(n_experts, device=indices.device, dtype=expert.dtype)
    ends = torch.searchsorted(expert, ids, right=True).to(torch.int32)
    return ExpertBatch(
        order=order,
        rows=order // top_k,
        weights=weights.reshape(-1).float().index_select(0, order),
        ends=ends,
    )


def combine(
    y: torch.Tensor, batch: ExpertBatch, rows: int, top_k: int, *, in_order: bool = False
) -> torch.Tensor:
    """``[rows, dim]`` fp32: each token's expert outputs times their weights, summed.

    Sorted outputs go back to pair order with a permutation (unique targets), then
    the ``top_k`` slots of each token are summed in slot order. ``in_order`` (the
    batch-invariant mode) spells that order out, ``((s0 + s1) + s2) + ...``, as one
    elementwise add per slot: torch's reduction over the slot dim may pick its kernel
    configuration (and with it the order of a row's adds) from the tensor's shape.
    """
    weighted = y.float() * batch.weights.unsqueeze(1)
    pairs = torch.empty_like(weighted).index_copy_(0, batch.order, weighted)
    slots = pairs.view(rows, top_k, -1)
    if not in_order:
        return slots.sum(1)
    total = slots[:, 0]
    for j in range(1, top_k):
        total = total + slots[:, j]
    return total.contiguous()


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    provider: str | None = None,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``sum_j weights[r, j] * expert_{indices[r, j]}(x[r])`` in fp32, chosen experts only.

    ``w1``/``w3`` ``[E, inter, dim]`` and ``w2`` ``[E, dim, inter]`` are stacked
    ``nn.Linear`` weights; their transposes are views, never copies.

    ``batch_invariant`` (the MoE's mode), on CUDA: the Triton grouped GEMM with
    ``INVARIANT_TILE_ROWS`` rows a tile whatever the batch (``provider`` is overridden), and
    the combine's slots added in order; a row's result then does not depend on the batch.
    """
    rows, top_k = indices.shape
    if rows == 0:  # decided from the shape: nothing to dispatch
        return torch.zeros(0, x.shape[1], dtype=torch.float32, device=x.device)
    fixed = invariant(batch_invariant, x, w1)
    batch = sort_by_expert(weights, indices, w1.shape[0])
    xs = x.index_select(0, batch.rows)  # [P, dim]
    # A token picks an expert at most once, so no group exceeds `rows` pairs.
    kw = {"capacity": rows, "provider": provider}
    if fixed:
        kw = {"provider": "triton", "block_rows": INVARIANT_TILE_ROWS}
    gate = grouped_mm(xs, w1.transpose(1, 2), batch.ends, **kw)
    up = grouped_mm(xs, w3.transpose(1, 2), batch.ends, **kw)
    # One launch between the grouped GEMMs on CUDA, same bits as silu then multiply.
    y = grouped_mm(silu_mul(gate, up), w2.transpose(1, 2), batch.ends, **kw)
    return combine(y, batch, rows, top_k, in_order=fixed)
