"""The batch inputs every backend stages, declared once.

Backends subclass :class:`BatchInputsPlan` (it registers no backend itself)
so the lengths, pool rows, cache locations and positions a layer reads have
one declaration, one pad value and one staging segment whatever the backend.
"""

from __future__ import annotations

import torch

from planner.schema import Plan, Setting, Tensor, tensor_field

I32 = torch.int32


class BatchInputsPlan(Plan):
    """The per-request and per-token inputs of a forward batch, staged as they are."""

    seq_lens: Tensor = tensor_field(
        I32,
        ("reqs",),
        source="seq_lens",
        pad=Setting("next_n"),
        doc="KV length per request, new tokens included",
    )
    req_pool_indices: Tensor = tensor_field(
        I32,
        ("reqs",),
        source="req_pool_indices",
        pad=0,
        doc="row of req_to_token; padding uses the null request 0",
    )
    out_cache_loc: Tensor = tensor_field(
        I32,
        ("rows",),
        source="out_cache_loc",
        pad=0,
        doc="KV slot each new token is written to; 0 is the null slot",
    )
    positions: Tensor = tensor_field(
        I32, ("rows",), source="positions", pad=0, doc="position of each query token"
    )
