"""Layer-side NSA for extend batches: the ragged indexer's top-k over an :class:`NSAExtendPlan`.

Per layer: gather the requests' index keys flat (``kv_slots``), score the query tokens in
chunks of ``plan.indexer_chunk_rows`` with deep_gemm's ``fp8_mqa_logits`` in its
compressed layout, ``plan.max_seq_len`` columns a row, and keep each token's best
``topk`` (``row_topk``); a token whose causal KV fits in ``topk`` takes all of it instead,
chosen per row with ``torch.where``, and is not scored (an empty range). Chunk bounds come
from the token count (a shape) and the plan's scalars, never from the batch's values
(``extend_ops``), so the whole function has static shapes and no host reads: a CUDA graph
captures it, its chunks valid for every batch it replays. Sparse MLA then reads the
selected slots exactly as in decode (``sparse_mla_decode``, one row per query token).
"""

from __future__ import annotations

import torch

from backends.deepgemm import fp8_mqa_logits, gather_index_cache
from backends.nsa.extend_ops import indexer_chunk_bounds
from backends.nsa.extend_plan import NSAExtendPlan
from backends.nsa.topk import row_topk
from planner.errors import PlanError


def indexer_topk_extend(
    plan: NSAExtendPlan, q_fp8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor
) -> torch.Tensor:
    """Cache slots each query token attends to: ``int32 [tokens, topk]``, ``-1`` past its count.

    ``q_fp8 [tokens, H, D]`` and ``weights [tokens, H]`` (query scales folded in)
    as for the decode indexer; this step's keys must already be in the cache.
    Tokens with more than ``topk`` KV tokens keep their ``topk`` best (``row_topk``, the
    decode indexer's rules: ties to the lowest position); the others take all of theirs,
    in position order.
    """
    tokens = plan.positions.shape[0]
    if q_fp8.shape[0] != tokens or weights.shape[0] != tokens:
        raise PlanError(
            "one indexer row per query token",
            field="q_fp8",
            expected=tokens,
            actual=(q_fp8.shape[0], weights.shape[0]),
        )
    topk, slots, width = plan.topk, plan.kv_slots, plan.max_seq_len
    ks, ke = plan.kv_ranges[0], plan.kv_ranges[1]
    last = slots.shape[0] - 1
    col = torch.arange(topk, device=slots.device)
    whole = torch.where(
        col < plan.topk_lens[:, None], slots[(ks[:, None] + col).clamp(max=last).long()], -1
    )
    if width <= topk:  # a plan scalar: no token's KV exceeds top-k, none is scored
        return whole.to(torch.int32)
    keys = gather_index_cache(index_cache, slots)
    # A token whose causal KV fits in top-k takes all of it (``whole``): its score range is
    # emptied, so the logits kernel and the selection do no work for it. ``width`` is a
    # bound under a graph (the bucket's), so without this every token would be scored.
    needs_scores = plan.kv_lens > topk
    ke = torch.where(needs_scores, ke, ks)
    count = (ke - ks).contiguous()
    best = torch.empty(tokens, topk, dtype=torch.int32, device=slots.device)
    for first, end in indexer_chunk_bounds(tokens, plan.indexer_chunk_rows):
        logits = fp8_mqa_logits(
            q_fp8[first:end].contiguous(),
            keys,
            weights[first:end].contiguous(),
            ks[first:end].contiguous(),
            ke[first:end].contiguous(),
            max_seqlen_k=width,
        )
        # The decode indexer's selection, rules and all (length-aware, ties to the lowest
        # position): a prompt fed in chunks keeps what feeding it token by token keeps.
        row_topk(logits, count[first:end], topk, best[first:end])
    picked = slots[(ks[:, None] + best.clamp(min=0)).clamp(max=last).long()]
    scored = torch.where(best >= 0, picked, -1)
    return torch.where(needs_scores[:, None], scored, whole).to(torch.int32)
