"""The paged backend's plan: what a paged decode / verify attention kernel reads.

The smallest complete backend: one schema, no ops of its own (it reuses the
shared ones in ``backends.common``). The README and docs/backends.md point here as
the in-tree model of a backend.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.common.inputs import BatchInputsPlan
from planner.schema import PAD_DERIVED, Setting, Tensor, scalar_field, tensor_field

I32 = torch.int32


def causal_kv_lens_field() -> Any:
    """The causal KV length of each query row, as a field of its own for each schema that
    declares it (the planner computes it once for all of them: same op, same inputs)."""
    return tensor_field(
        I32,
        ("rows",),
        op="causal_lengths",
        inputs=("seq_lens",),
        params={"next_n": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="causal KV length of each query row; padding rows get 1..next_n, never 0",
    )


class PagedPlan(BatchInputsPlan, backend="paged"):
    """What a paged decode / verify attention kernel reads in every layer."""

    kv_lens: Tensor = causal_kv_lens_field()
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
