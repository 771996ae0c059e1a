"""Layer-side NSA for extend batches: the ragged indexer's top-k over an :class:`NSAExtendPlan`.

Per layer: gather the request's index keys flat (``kv_slots``), start every
token with all of its causal range (right for the tokens the plan takes
whole), then score the plan's chunks with deep_gemm's ``fp8_mqa_logits`` in
its compressed layout and keep each scored token's best ``topk``. Every
boundary (ranges, chunks, widths) comes from the plan; nothing about the
batch is computed here. Sparse MLA then reads the selected slots exactly as
in decode (``sparse_mla_decode``, one row per query token).
"""

from __future__ import annotations

import torch

from backends.deepgemm import fp8_mqa_logits, gather_index_cache
from backends.nsa.extend_plan import NSAExtendPlan
from backends.nsa.topk import row_topk
from planner.errors import PlanError


def indexer_topk_extend(
    plan: NSAExtendPlan, q_fp8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor
) -> torch.Tensor:
    """Cache slots each query token attends to: ``int32 [tokens, topk]``, ``-1`` past its count.

    ``q_fp8 [tokens, H, D]`` and ``weights [tokens, H]`` (query scales folded in)
    as for the decode indexer; this step's keys must already be in the cache.
    Scored tokens keep their ``topk`` best KV tokens (``row_topk``, the decode indexer's
    rules: ties to the lowest position); the others take all of theirs.
    """
    tokens = plan.positions.shape[0]
    if q_fp8.shape[0] != tokens or weights.shape[0] != tokens:
        raise PlanError(
            "one indexer row per query token",
            field="q_fp8",
            expected=tokens,
            actual=(q_fp8.shape[0], weights.shape[0]),
        )
    topk, slots = plan.topk, plan.kv_slots
    ks, ke = plan.kv_ranges[0], plan.kv_ranges[1]
    col = torch.arange(topk, device=slots.device)
    whole = torch.where(
        col < plan.topk_lens[:, None],
        slots[(ks[:, None] + col).clamp(max=slots.shape[0] - 1).long()],
        -1,
    )
    chunks = plan.indexer_chunks.chunks
    if not chunks:
        return whole.to(torch.int32)
    keys = gather_index_cache(index_cache, slots)
    for first, end, width in chunks:
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
        count = (ke[first:end] - ks[first:end]).contiguous()
        best = torch.empty(end - first, topk, dtype=torch.int32, device=logits.device)
        row_topk(logits, count, topk, best)
        picked = slots[
            (ks[first:end, None] + best.clamp(min=0)).clamp(max=slots.shape[0] - 1).long()
        ]
        whole[first:end] = torch.where(best >= 0, picked, -1)
    return whole.to(torch.int32)
