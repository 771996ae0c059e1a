"""Layer-side NSA for extend batches: the ragged indexer's top-k over an :class:`NSAExtendPlan`.

Per layer: gather the requests' index keys flat (``kv_slots``; on CUDA only the batch's
``kv_indptr[-1]`` entries, however long the graph's bound), score the query tokens in
chunks of ``plan.indexer_chunk_rows`` with deep_gemm's ``fp8_mqa_logits`` in its
compressed layout, ``plan.max_seq_len`` columns a row, and keep each token's best
``topk`` (``row_topk``); a token whose causal KV fits in ``topk`` takes all of it instead,
and is not scored (an empty range). The gather and the final choice of slots are one
Triton launch each on CUDA (``extend_triton``); their torch forms here are the references
and the CPU's path. Chunk bounds come from the token count (a shape) and the plan's
scalars, never from the batch's values (``extend_ops``), so the whole function has static
shapes and no host reads: a CUDA graph captures it, its chunks valid for every batch it
replays. Sparse MLA then reads the
selected slots exactly as in decode (``sparse_mla_decode``, one row per query token).
"""

from __future__ import annotations

import torch

from backends.common.triton_kernels import triton_available
from backends.deepgemm import fp8_mqa_logits, gather_index_cache
from backends.deepgemm.fp8 import as_words, index_cache_views
from backends.nsa.extend_ops import indexer_chunk_bounds
from backends.nsa.extend_plan import NSAExtendPlan
from backends.nsa.extend_triton import gather_index_keys_triton, select_slots_triton
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
    if width <= topk:  # a plan scalar: no token's KV exceeds top-k, none is scored
        return select_slots(slots, ks, plan.kv_lens, plan.topk_lens, None, topk)
    keys = gather_keys(index_cache, slots, plan.kv_indptr[-1:])
    # A token whose causal KV fits in top-k takes all of it: its score range is emptied,
    # so the logits kernel and the selection do no work for it. ``width`` is a bound
    # under a graph (the bucket's), so without this every token would be scored.
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
    return select_slots(slots, ks, plan.kv_lens, plan.topk_lens, best, topk)


def gather_keys(
    index_cache: torch.Tensor, slots: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index keys and scales of ``slots``, flat: ``(k_fp8 [N, D], k_scale [N])``. On
    CUDA only the first ``count`` (a device scalar: the batch's flat KV) are written, one
    launch (``extend_triton``): the entries past it are never in a score range. Elsewhere,
    or for keys the kernel cannot address (rows not dense within a page, a width that is
    not a power-of-two count of words), every entry (``gather_index_cache``, the reference)."""
    if not (slots.is_cuda and triton_available(slots.device)):
        return gather_index_cache(index_cache, slots)
    k_view, s_view = index_cache_views(index_cache)
    words = as_words(k_view)
    width = words.shape[-1]
    addressable = words.stride()[1:] == (width, 1) and s_view.stride(1) == 1
    if not addressable or width & (width - 1):
        return gather_index_cache(index_cache, slots)
    keys = torch.empty(slots.shape[0], width, dtype=words.dtype, device=slots.device)
    scales = torch.empty(slots.shape[0], dtype=torch.float32, device=slots.device)
    gather_index_keys_triton(words, s_view, slots, count, keys, scales)
    return keys.view(torch.uint8).view(torch.float8_e4m3fn), scales


def select_slots(
    slots: torch.Tensor,
    ks: torch.Tensor,
    kv_lens: torch.Tensor,
    topk_lens: torch.Tensor,
    best: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    """Each token's attended cache slots, ``int32 [tokens, topk]``, -1 past its count: a
    token with more than ``topk`` KV tokens its scored ``best`` offsets (-1 where none),
    any other its first ``topk_lens`` slots in position order (``best`` None: every token).
    One launch on CUDA (``extend_triton``), else :func:`select_slots_reference`."""
    if slots.is_cuda and triton_available(slots.device):
        return select_slots_triton(slots, ks, kv_lens, topk_lens, best, topk)
    return select_slots_reference(slots, ks, kv_lens, topk_lens, best, topk)


def select_slots_reference(
    slots: torch.Tensor,
    ks: torch.Tensor,
    kv_lens: torch.Tensor,
    topk_lens: torch.Tensor,
    best: torch.Tensor | None,
    topk: int,
) -> torch.Tensor:
    """The exact torch form of :func:`select_slots`."""
    last = slots.shape[0] - 1
    col = torch.arange(topk, device=slots.device)
    whole = torch.where(
        col < topk_lens[:, None], slots[(ks[:, None] + col).clamp(max=last).long()], -1
    )
    if best is None:
        return whole.to(torch.int32)
    picked = slots[(ks[:, None] + best.clamp(min=0)).clamp(max=last).long()]
    scored = torch.where(best >= 0, picked, -1)
    return torch.where((kv_lens > topk)[:, None], scored, whole).to(torch.int32)
