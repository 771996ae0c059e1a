"""Exact torch reference of the split path of the Triton sparse MLA decode kernel.

The attention itself is ``backends.nsa.attention.sparse_mla_decode``; this module
reproduces how the kernel gets there, in float64: for every (row, split) of the plan a
softmax over that split's valid slots only, kept as a normalised partial output and its
log-sum-exp, then the log-sum-exp weighted combine. Tests compare the kernel's
workspace with the partials (catching a wrong split or lse even where the combine would
hide it) and the combined result with ``sparse_mla_decode`` (proving the split algebra).

Conventions shared with the kernel: ``lse`` is in natural log; a split with no valid
slot has ``lse = -inf`` and a zero partial; an empty split (``begin == end``) is never
written by the kernel, so its entries here are only the reference's own (-inf, 0).
Positions at or past a row's last boundary are never read, as in the kernel: the
indexer writes ``-1`` there, and callers must keep it that way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from backends.nsa.attention import sparse_mla_decode

__all__ = ["SplitReference", "mask_past_plan", "plain_reference", "sparse_mla_split_reference"]


class SplitReference(NamedTuple):
    out: torch.Tensor  # [rows, H, latent] in ``dtype``
    partial: torch.Tensor  # [rows, splits, H, latent]: each split's normalised output
    lse: torch.Tensor  # [rows, splits, H]: natural-log log-sum-exp of each split's logits


def mask_past_plan(topk_slots: torch.Tensor, split_plan: torch.Tensor) -> torch.Tensor:
    """``topk_slots`` with every position the plan never reads set to ``-1``.

    What ``sparse_mla_decode`` must see to equal the kernel when a caller's slots hold
    valid entries past ``topk_lens`` (the indexer never writes such entries).
    """
    rows, width = topk_slots.shape
    end = split_plan[:rows, -1].to(torch.int64).unsqueeze(1)
    pos = torch.arange(width, device=topk_slots.device).unsqueeze(0)
    return torch.where(pos < end, topk_slots, torch.full_like(topk_slots, -1))


def sparse_mla_split_reference(
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    softmax_scale: float,
    split_plan: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
) -> SplitReference:
    """Per-split partials and their combine, computed in ``dtype`` (float64 by default).

    Each split is checked against the plain reference by construction: the combined
    ``out`` equals ``sparse_mla_decode`` on ``mask_past_plan(topk_slots, split_plan)``
    up to rounding (the tests assert it).
    """
    rows, heads, latent = q_nope_abs.shape
    splits = split_plan.shape[1] - 1
    slots = topk_slots.to(torch.int64)
    valid = slots >= 0
    kv = kv_cache[slots.clamp(min=0)].to(dtype)  # [rows, K, latent + rope]
    lat, rope = kv[..., :latent], kv[..., latent:]
    logits = torch.einsum("rhd,rkd->rhk", q_nope_abs.to(dtype), lat)
    logits = (logits + torch.einsum("rhd,rkd->rhk", q_rope.to(dtype), rope)) * softmax_scale

    bounds = split_plan[:rows].to(torch.int64)
    pos = torch.arange(slots.shape[1], device=slots.device)
    partial = torch.zeros(rows, splits, heads, latent, dtype=dtype, device=q_nope_abs.device)
    lse = torch.full((rows, splits, heads), float("-inf"), dtype=dtype, device=q_nope_abs.device)
    for s in range(splits):
        take = valid & (pos >= bounds[:, s : s + 1]) & (pos < bounds[:, s + 1 : s + 2])
        masked = logits.masked_fill(~take.unsqueeze(1), float("-inf"))  # [rows, H, K]
        lse_s = torch.logsumexp(masked, dim=-1)  # -inf where the split has no valid slot
        live = torch.isfinite(lse_s)
        p = torch.exp(masked - torch.where(live, lse_s, torch.zeros_like(lse_s)).unsqueeze(-1))
        partial[:, s] = torch.einsum("rhk,rkd->rhd", p * take.unsqueeze(1), lat)
        lse[:, s] = lse_s

    total = torch.logsumexp(lse, dim=1, keepdim=True)  # [rows, 1, H]
    live = torch.isfinite(total)
    weight = torch.exp(lse - torch.where(live, total, torch.zeros_like(total)))
    out = (weight.unsqueeze(-1) * partial).sum(dim=1)
    return SplitReference(out, partial, lse)


def plain_reference(
    q_nope_abs: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    softmax_scale: float,
    split_plan: torch.Tensor,
) -> torch.Tensor:
    """``sparse_mla_decode`` in fp32 on what the kernel reads (the benchmark's reference)."""
    return sparse_mla_decode(
        q_nope_abs.float(),
        q_rope.float(),
        kv_cache,
        mask_past_plan(topk_slots, split_plan),
        softmax_scale,
    )
