"""Sparse MLA on FlashInfer's MLA kernel, reading the per-batch ``NSAFlashInferPlan``.

Per layer: the indexer's ``topk_slots [rows, topk]`` are written into the planned slot's
index buffer (clamped at 0: FlashInfer reads only the first ``kv_len[r]`` of row ``r``'s
list, which the length-aware top-k fills with valid slots, so what lies past it is never
read but must stay a legal slot for no-op rows), then FlashInfer's ``run`` attends over
strided views of the 576-wide cache (latent ``[:, :512]``, rope ``[:, 512:]``): no copy.
Both are static in shape and sync-free, so they are captured with the layer.

Without FlashInfer the torch reference reads the same things FlashInfer would (the
index buffer through ``kv_indptr`` and ``kv_len``) and runs the exact sparse MLA
reference over them: a wrong table fails the CPU tests, not the first GPU run.
"""

from __future__ import annotations

import torch

from backends.nsa.attention import check_mla_inputs, sparse_mla_decode
from backends.nsa_flashinfer.plan import NSAFlashInferPlan
from backends.nsa_flashinfer.slots import SparseSlot
from planner.errors import PlanError

__all__ = ["reference_sparse_mla", "sparse_mla_flashinfer"]


def _slot(plan: NSAFlashInferPlan) -> SparseSlot:
    handle = plan.wrapper
    if handle is None or not handle.current:
        raise PlanError(
            "no FlashInfer wrapper is planned for this plan: the nsa_flashinfer_plan host op did "
            "not run for it, or a newer eager plan replaced it (plan again)",
            field="plan_info",
        )
    return handle.slot


def _check(
    plan: NSAFlashInferPlan,
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    softmax_scale: float,
) -> int:
    rows = plan.kv_len.shape[0]
    if q_nope_abs.shape[0] != rows:
        raise PlanError(
            "query rows do not match the plan",
            field="q_nope_abs",
            expected=rows,
            actual=q_nope_abs.shape[0],
        )
    if tuple(topk_slots.shape) != (rows, plan.topk):
        raise PlanError(
            "topk_slots must be [rows, topk] of the plan",
            field="topk_slots",
            expected=(rows, plan.topk),
            actual=tuple(topk_slots.shape),
        )
    if softmax_scale != plan.sm_scale:
        raise PlanError(
            "FlashInfer was planned with another softmax scale (nsa_flashinfer.sparse_sm_scale)",
            field="softmax_scale",
            expected=plan.sm_scale,
            actual=softmax_scale,
        )
    check_mla_inputs(q_nope_abs, q_rope, kv_cache)
    return rows


def _write_slots(slot: SparseSlot, topk_slots: torch.Tensor, rows: int) -> torch.Tensor:
    """The layer's slots into the planned buffer; a view of it, ``[rows * topk]``."""
    n = rows * slot.config.topk
    if n > slot.kv_indices.shape[0]:
        raise PlanError(
            "the planned index buffer is smaller than the batch",
            field="topk_slots",
            expected=f"<= {slot.kv_indices.shape[0]} slots",
            actual=n,
        )
    buf = slot.kv_indices[:n]
    torch.clamp(topk_slots.reshape(-1), min=0, out=buf)
    return buf


def reference_sparse_mla(
    plan: NSAFlashInferPlan,
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """What FlashInfer computes from the plan: row ``r`` over ``indices[kv_indptr[r] + t]``,
    ``t < kv_len[r]``, by the exact sparse MLA reference (static shapes: capturable)."""
    topk = plan.topk
    starts = plan.kv_indptr[:-1].long().unsqueeze(1)
    t = torch.arange(topk, device=indices.device)
    where = (starts + t).clamp(max=indices.shape[0] - 1)
    slots = torch.where(t < plan.kv_len.unsqueeze(1), indices[where], -1).to(torch.int32)
    return sparse_mla_decode(q_nope_abs, q_rope, kv_cache, slots, plan.sm_scale)


def sparse_mla_flashinfer(
    plan: NSAFlashInferPlan,
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """``sparse_mla_decode``'s result (bf16: within ~1e-2 of it) by FlashInfer's MLA kernel.

    ``topk_slots`` is this layer's indexer output (``-1`` past each row's ``kv_len``,
    valid below it); ``softmax_scale`` must be the one the plan was made with.
    """
    rows = _check(plan, q_nope_abs, q_rope, kv_cache, topk_slots, softmax_scale)
    slot = _slot(plan)
    indices = _write_slots(slot, topk_slots, rows)
    if slot.wrapper is None:
        return reference_sparse_mla(plan, q_nope_abs, q_rope, kv_cache, indices)
    latent = q_nope_abs.shape[2]
    out = torch.empty_like(q_nope_abs)
    slot.wrapper.run(
        q_nope_abs, q_rope, kv_cache[:, None, :latent], kv_cache[:, None, latent:], out=out
    )
    return out
