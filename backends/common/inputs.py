"""The batch inputs every backend stages, declared once per batch shape.

Backends subclass :class:`BatchInputsPlan` (uniform batches: decode, verify)
or :class:`RaggedInputsPlan` (extend, mixed); neither registers a backend
itself, so the lengths, pool rows, cache locations and positions a layer reads
have one declaration, one pad value and one staging segment whatever the backend.
"""

from __future__ import annotations

import torch

from planner.batch import RAGGED_MODES
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


class RaggedInputsPlan(Plan, modes=RAGGED_MODES):
    """The inputs of an extend or mixed batch: each request adds its own number of tokens.

    Per-token inputs are over ``tokens`` (the extend lengths' sum), per-request
    ones over ``reqs``. A captured ragged batch is padded to its bucket: a padding
    request adds no token (``extend_lens`` 0) and holds one null KV entry (``seq_lens``
    1, pool row 0); padding tokens, after every request's, write the null slot 0
    (``planner.planner`` states the layout).
    """

    seq_lens: Tensor = tensor_field(
        I32, ("reqs",), source="seq_lens", pad=1, doc="KV length per request, new tokens included"
    )
    extend_lens: Tensor = tensor_field(
        I32, ("reqs",), source="extend_lens", pad=0, doc="tokens each request adds this step"
    )
    req_pool_indices: Tensor = tensor_field(
        I32, ("reqs",), source="req_pool_indices", pad=0, doc="row of req_to_token"
    )
    out_cache_loc: Tensor = tensor_field(
        I32,
        ("tokens",),
        source="out_cache_loc",
        pad=0,
        doc="KV slot each new token is written to, request-major",
    )
    positions: Tensor = tensor_field(
        I32, ("tokens",), source="positions", pad=0, doc="position of each query token"
    )
