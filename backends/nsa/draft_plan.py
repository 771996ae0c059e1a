"""The NSA draft-extend plan: the draft model catching up on each request's accepted tokens.

After a verify, request ``b`` accepted ``e[b]`` tokens (1..``next_n``, its own
number). The draft model's layers must see them under static graph shapes, so
every request gets ``next_n`` rows, row ``b * next_n + i`` holding accepted
token ``i`` for ``i < e[b]``; the rows past it are padding. The batch gives
the accepted tokens flat (``out_cache_loc`` and ``positions``, one per token);
this plan spreads them over the rows itself, so padding rows can only hold the
pad values (the null slot 0, position 0, KV length 1) and a layer reading the
plan cannot mistake them for tokens:

- ``kv_lens`` are built from the accepted counts (``seq_lens - e + i + 1``),
  never from the ``next_n`` staircase a verify has (the upstream bug: expanded
  lengths built from the wrong lengths);
- ``row_valid`` marks the real rows, ``row_tokens`` says which flat token each
  row reads its inputs from, ``logit_rows`` the row of each request's last
  accepted token;
- rows are always expanded for the indexer (``kernel_next_n = 1``): a native
  next_n kernel computes every row of a request up to its last row's length,
  which a padding row does not have.

It has its own static buffers and schedule, so a replay never refreshes a
verify's (the other upstream bug: draft-extend replay with verify offsets).
"""

from __future__ import annotations

import torch

from backends.common import row_ops as _row_ops  # noqa: F401  (registers the row-layout ops)
from backends.nsa.plan import NSAPlan
from planner.batch import ForwardMode
from planner.schema import PAD_DERIVED, Setting, Tensor, tensor_field

I32 = torch.int32


class NSADraftExtendPlan(NSAPlan, backend="nsa", modes=frozenset({ForwardMode.DRAFT_EXTEND})):
    """What the draft model's indexer and sparse MLA read when it catches up on accepted tokens."""

    row_mask = "row_valid"

    seq_lens: Tensor = tensor_field(
        I32,
        ("reqs",),
        source="seq_lens",
        pad=1,
        doc="KV length per request, its accepted tokens included; padding requests hold 1",
    )
    extend_lens: Tensor = tensor_field(
        I32,
        ("reqs",),
        source="extend_lens",
        pad=1,
        doc="tokens each request accepted (1..next_n); padding requests accept 1",
    )
    token_cache_loc: Tensor = tensor_field(
        I32,
        ("tokens",),
        source="out_cache_loc",
        pad=0,
        doc="KV slot of each accepted token, flat, request-major",
    )
    token_positions: Tensor = tensor_field(
        I32, ("tokens",), source="positions", pad=0, doc="position of each accepted token, flat"
    )
    qo_indptr: Tensor = tensor_field(
        I32,
        ("reqs+1",),
        op="cumsum_with_zero",
        inputs=("extend_lens",),
        pad=PAD_DERIVED,
        doc="offsets of each request's accepted tokens in the flat inputs",
    )
    row_valid: Tensor = tensor_field(
        I32,
        ("rows",),
        op="row_mask",
        inputs=("extend_lens",),
        params={"next_n": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="1 on rows holding an accepted token, 0 on padding rows",
    )
    row_tokens: Tensor = tensor_field(
        I32,
        ("rows",),
        op="row_tokens",
        inputs=("qo_indptr", "extend_lens"),
        params={"next_n": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="the flat token each row reads its input id and hidden state from",
    )
    out_cache_loc: Tensor = tensor_field(
        I32,
        ("rows",),
        op="spread_rows",
        inputs=("token_cache_loc", "qo_indptr", "extend_lens"),
        params={"next_n": Setting("next_n"), "pad": 0},
        pad=0,
        doc="KV slot each row writes; padding rows write the null slot 0",
    )
    positions: Tensor = tensor_field(
        I32,
        ("rows",),
        op="spread_rows",
        inputs=("token_positions", "qo_indptr", "extend_lens"),
        params={"next_n": Setting("next_n"), "pad": 0},
        pad=0,
        doc="position of each row's token; 0 on padding rows",
    )
    kv_lens: Tensor = tensor_field(
        I32,
        ("rows",),
        op="accepted_causal_lengths",
        inputs=("seq_lens", "extend_lens"),
        params={"next_n": Setting("next_n"), "pad": 1},
        pad=1,
        doc="causal KV length of each row: seq_lens - e + i + 1 for accepted tokens, 1 on padding",
    )
    logit_rows: Tensor = tensor_field(
        I32,
        ("reqs",),
        op="last_accepted_rows",
        inputs=("extend_lens",),
        params={"next_n": Setting("next_n")},
        pad=PAD_DERIVED,
        doc="row of each request's last accepted token: the draft's output rows",
    )
