"""The per-token (ragged) metadata ops of extend / prefill batches, with their providers.

Each op's ``torch`` provider is the exact reference (``ragged_ref``: graph-safe, no host
syncs, no data-dependent shapes); ``triton`` (``ragged_triton``) is one launch per op,
tested bit-equal against the reference under ``TRITON_INTERPRET=1``. ``qo_indptr`` and
``kv_indptr`` are the ``cumsum_with_zero`` of ``extend_lens`` and ``seq_lens``; ``b`` below is
the request owning token ``t`` (``qo_indptr[b] <= t < qo_indptr[b+1]``) and ``position`` is
``seq_lens[b] - qo_indptr[b+1] + t``. Tokens ``t >= qo_indptr[reqs]`` are padding.

Importing this module registers the ops (``backends.common`` does).
"""

from __future__ import annotations

from backends.common import ragged_ref as ref
from backends.common import ragged_triton as tri
from backends.common.ops import with_providers
from planner.ops import metadata_op

token_request = metadata_op(
    "token_request",
    "out[t] = b, the request owning query token t (qo_indptr[b] <= t < qo_indptr[b+1]); padding pad.",
)
token_positions = metadata_op(
    "token_positions",
    "out[t] = seq_lens[b] - qo_indptr[b+1] + t: prefix length plus offset in the request; padding 0.",
)
token_causal_lengths = metadata_op(
    "token_causal_lengths",
    "out[t] = position + 1: the KV length token t attends to causally; padding 1, never 0.",
)
token_topk_lengths = metadata_op(
    "token_topk_lengths",
    "out[t] = min(position + 1, topk): KV tokens sparse attention reads per token; padding 1.",
)
token_kv_ranges = metadata_op(
    "token_kv_ranges",
    "out[0, t], out[1, t] = ks, ke = kv_indptr[b], kv_indptr[b] + position + 1: fp8_mqa_logits' "
    "KV range over the flat gathered KV; padding (0, 1).",
)
kv_gather_slots = metadata_op(
    "kv_gather_slots",
    "out[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j] for j < seq_lens[b]: the flat "
    "gathered KV's slots; 0 (the null slot) from kv_indptr[reqs] on.",
)

last_token_rows = metadata_op(
    "last_token_rows",
    "out[b, i] = min(max(qo_indptr[b+1] - n + i, qo_indptr[b]), qo_indptr[b+1] - 1) for out "
    "[reqs, n] (out[b] = qo_indptr[b+1] - 1 for [reqs]): the rows of request b's last n query "
    "tokens, whose logits the head computes (a shorter request repeats its first row).",
)
slot_pages = metadata_op(
    "slot_pages",
    "out[0, t], out[1, t] = loc // page_size, loc % page_size of out_cache_loc[t]: where token t's "
    "KV goes in a paged cache; padding (0, 0).",
)

with_providers(
    [
        (token_request, ref.token_request, tri.token_request),
        (token_positions, ref.token_positions, tri.token_positions),
        (token_causal_lengths, ref.token_causal_lengths, tri.token_causal_lengths),
        (token_topk_lengths, ref.token_topk_lengths, tri.token_topk_lengths),
        (token_kv_ranges, ref.token_kv_ranges, tri.token_kv_ranges),
        (kv_gather_slots, ref.kv_gather_slots, tri.kv_gather_slots),
        (last_token_rows, ref.last_token_rows, tri.last_token_rows),
        (slot_pages, ref.slot_pages, tri.slot_pages),
    ]
)
