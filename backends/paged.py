"""A generic paged-attention backend: the smallest complete example of a backend.

One schema (what the attention kernel reads), no new ops (it reuses the
generic ones), and a torch attention that consumes the plan. This file is
the README's example of registering a backend.
"""

from __future__ import annotations

import torch

from backends.inputs import BatchInputsPlan
from planner.errors import PlanError
from planner.schema import PAD_DERIVED, Setting, Tensor, scalar_field, tensor_field

I32 = torch.int32


class PagedPlan(BatchInputsPlan, backend="paged"):
    """What a paged decode / verify attention kernel reads in every layer."""

    kv_lens: Tensor = tensor_field(
        I32,
        ("rows",),
        op="causal_lengths",
        inputs=("seq_lens",),
        params={"next_n": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="causal KV length of each query row; padding rows get 1..next_n, never 0",
    )
    cu_seqlens_k: Tensor = tensor_field(
        I32,
        ("reqs+1",),
        op="cumsum_with_zero",
        inputs=("seq_lens",),
        pad=PAD_DERIVED,
        doc="KV offsets per request",
    )
    token_slots: Tensor = tensor_field(
        I32,
        ("reqs", "max_len"),
        op="gather_token_slots",
        inputs=("req_to_token", "req_pool_indices", "seq_lens"),
        pad=0,
        doc="physical slot of each logical token position; 0 past the length",
    )
    page_table: Tensor = tensor_field(
        I32,
        ("reqs", "pages"),
        op="page_table",
        inputs=("token_slots",),
        params={"page_size": Setting("page_size")},
        pad=0,
        doc="page ids per request; 0 is the null page",
    )
    max_seq_len: int = scalar_field("max_len", doc="longest KV length the kernels must handle")
    next_n: int = scalar_field("next_n", doc="query tokens per request")


def _need(plan: object, name: str) -> torch.Tensor:
    """Layers read plans; a missing field is an error, never a per-layer recomputation."""
    if not hasattr(plan, name):
        raise PlanError(
            "plan lacks a field this layer reads", field=name, actual=type(plan).__name__
        )
    return getattr(plan, name)


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
    token_slots = _need(plan, "token_slots")
    kv_lens = _need(plan, "kv_lens")
    next_n = int(_need(plan, "next_n"))
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
