"""The paged backend's attention: a torch reference that reads a :class:`PagedPlan`."""

from __future__ import annotations

import torch

from backends.paged.plan import PagedPlan


def paged_attention(
    plan: PagedPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference paged attention over a plan: q ``[rows, H, D]``, caches ``[slots, Hkv, D]``.

    Graph-capturable: gathers every position up to the plan's width and masks
    past each row's causal length, so shapes never depend on values.
    """
    token_slots = plan.token_slots
    kv_lens = plan.kv_lens
    next_n = int(plan.next_n)
    rows, heads, dim = q.shape
    slots = token_slots.repeat_interleave(next_n, dim=0) if next_n > 1 else token_slots
    keys = k_cache[slots.long()]  # [rows, L, Hkv, D]
    values = v_cache[slots.long()]
    group = heads // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2).float()
    values = values.repeat_interleave(group, dim=2).float()
    logits = torch.einsum("rhd,rlhd->rhl", q.float(), keys) * scale
    width = slots.shape[1]
    valid = torch.arange(width, device=q.device)[None, :] < kv_lens[:, None]
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("rhl,rlhd->rhd", probs, values).to(q.dtype)
