"""The NSA extend plan: what DeepSeek-V3.2's indexer and sparse MLA read in prefill.

An extend batch adds a different number of tokens per request after an
optional cached prefix. The ragged indexer (deep_gemm's ``fp8_mqa_logits``)
reads every request's KV gathered flat, in request order, and each query
token its causal range of it: token ``t`` at position ``p`` of request ``b``
reads ``[kv_indptr[b], kv_indptr[b] + p + 1)``. Sparse MLA then reads the
top-k of those, as in decode. Mixed batches (decode requests are extends of
one token, verify requests of ``next_n``) use the same plan; their head reads each
request's last ``next_n`` rows (``logit_rows``, ``planner.batch.LOGIT_ROWS_MODES``). The indexer's chunks (``indexer_chunk_rows``) follow
from ``max_seq_len`` and the logits budget alone (``extend_ops``), so nothing the layers
read depends on host values other than the plan's scalars.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from backends.common.inputs import RaggedInputsPlan
from backends.nsa import mla_split
from backends.nsa.extend_ops import indexer_chunk_rows
from planner.errors import SchemaError
from planner.schema import (
    PAD_DERIVED,
    Setting,
    Tensor,
    scalar_field,
    tensor_field,
)

I32 = torch.int32

LOGITS_BUDGET = 512 << 20
"""Default bytes of indexer logits one chunk may take (the engines' prefill logits budget)."""


class NSAExtendPlan(RaggedInputsPlan, backend="nsa"):
    """What the indexer and sparse MLA read for extend and mixed batches, in every layer."""

    defaults: ClassVar[dict[str, Any]] = {
        "topk": 2048,
        "indexer_logits_bytes": LOGITS_BUDGET,
        **mla_split.DEFAULTS,
    }

    qo_indptr: Tensor = tensor_field(
        I32,
        ("reqs+1",),
        op="cumsum_with_zero",
        inputs=("extend_lens",),
        pad=PAD_DERIVED,
        doc="query-token offsets per request",
    )
    kv_indptr: Tensor = tensor_field(
        I32,
        ("reqs+1",),
        op="cumsum_with_zero",
        inputs=("seq_lens",),
        pad=PAD_DERIVED,
        doc="offsets of each request's KV in the flat gathered KV",
    )
    kv_slots: Tensor = tensor_field(
        I32,
        ("kv_tokens",),
        op="kv_gather_slots",
        inputs=("req_to_token", "req_pool_indices", "kv_indptr"),
        pad=0,
        doc="cache slot of every flat KV entry, request after request",
    )
    token_request: Tensor = tensor_field(
        I32,
        ("tokens",),
        op="token_request",
        inputs=("qo_indptr",),
        params={"pad": 0},
        pad=0,
        doc="the request each query token belongs to",
    )
    kv_lens: Tensor = tensor_field(
        I32,
        ("tokens",),
        op="token_causal_lengths",
        inputs=("qo_indptr", "seq_lens"),
        pad=1,
        doc="causal KV length of each query token (position + 1)",
    )
    kv_ranges: Tensor = tensor_field(
        I32,
        (2, "tokens"),
        op="token_kv_ranges",
        inputs=("qo_indptr", "kv_indptr"),
        pad=PAD_DERIVED,
        doc="ks (row 0) and ke (row 1): the flat KV range each token's indexer row reads",
    )
    topk_lens: Tensor = tensor_field(
        I32,
        ("tokens",),
        op="token_topk_lengths",
        inputs=("qo_indptr", "seq_lens"),
        params={"topk": Setting("topk")},
        pad=1,
        doc="KV tokens sparse attention reads per query token: min(kv_len, topk)",
    )
    cache_pages: Tensor = tensor_field(
        I32,
        (2, "tokens"),
        op="slot_pages",
        inputs=("out_cache_loc",),
        params={"page_size": Setting("page_size")},
        pad=PAD_DERIVED,
        doc="page (row 0) and offset in it (row 1) each new token's KV is written to",
    )
    logit_rows: Tensor = tensor_field(
        I32,
        ("reqs", "logit_n"),
        op="last_token_rows",
        inputs=("qo_indptr",),
        pad=PAD_DERIVED,
        doc="rows of each request's last logit_n tokens (1; a mixed batch's verify rows: "
        "next_n): the LM head runs on these rows only",
    )
    mla_split_plan: Tensor = mla_split.split_table_field("tokens")
    topk: int = scalar_field("topk", doc="tokens each query token attends to, at most")
    max_seq_len: int = scalar_field(
        "max_len", doc="longest KV length of a request: the indexer's logits row width"
    )
    indexer_chunk_rows: int = scalar_field(
        "indexer_chunk_rows",
        doc="query tokens one indexer chunk scores: max_seq_len-wide fp32 rows in the budget",
    )
    mla_splits: int = mla_split.splits_field()
    mla_kernel: str = mla_split.kernel_field()

    @classmethod
    def derived_dims(cls, dims: Mapping[str, int], settings: Mapping[str, Any]) -> dict[str, int]:
        """The sparse MLA kernel's split count for this many query tokens (see ``mla_split``;
        ``mla_fixed_splits`` whatever the tokens when set),
        and the indexer's chunk rows for this KV width (see ``extend_ops``): both pure
        functions of the dimensions, so a captured plan holds the static bound's."""
        chunk = indexer_chunk_rows(dims["max_len"], settings["indexer_logits_bytes"])
        return {**mla_split.split_dims(dims["tokens"], dims, settings), "indexer_chunk_rows": chunk}

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """Refused at planner build, naming the option, not at the first prefill."""
        mla_split.check_settings(settings)
        for name in ("topk", "indexer_logits_bytes"):
            value = settings[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SchemaError(
                    "must be a positive int", field=f"nsa.{name}", expected=">= 1", actual=value
                )
