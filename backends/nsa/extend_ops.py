"""The NSA extend plan's host op: how the prefill indexer's logits are cut into chunks.

The ragged indexer (deep_gemm's ``fp8_mqa_logits``) writes one fp32 score per
query token and KV token it reads: a 16k-token prefill over a 16k context is
a gigabyte. The chunking depends only on the batch's lengths, so it is
planned once per batch, on the host, from ``seq_lens_cpu`` and
``extend_lens_cpu``, and every layer walks the same chunks:

- a token whose causal KV length is at most ``topk`` takes all its KV tokens
  and needs no scores (the engines' "skip the indexer when the KV fits");
- the other tokens are cut, in order, into chunks of consecutive tokens
  whose compressed logits (``rows x widest row``, deep_gemm's
  ``max_seqlen_k`` layout, rows padded to 256 columns) fit the budget.

The op writes a 4-entry summary (chunks, scored tokens, tokens taken whole,
largest chunk's logits bytes) for dumps, and returns the chunks as the plan's
handle: extend batches run eagerly, so the layers read them on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from planner.ops import metadata_op

ROW_ALIGN = 256
"""deep_gemm pads each compressed logits row to a multiple of 256 columns."""

indexer_chunks = metadata_op(
    "indexer_chunks",
    "Host op: cut the scored tokens (causal KV length > topk) into consecutive chunks whose "
    "compressed fp32 logits fit the budget; out = [chunks, scored tokens, whole tokens, "
    "largest chunk bytes].",
)


@dataclass(frozen=True)
class IndexerChunks:
    """The chunks every indexer layer of one extend batch walks: ``(first, end, width)``.

    Tokens ``first .. end-1`` are scored together, each row ``width`` columns
    wide (the widest causal range among them). Tokens in no chunk take all
    their KV tokens.
    """

    chunks: tuple[tuple[int, int, int], ...]
    scored: int
    whole: int


def plan_chunks(
    seq_lens: np.ndarray, extend_lens: np.ndarray, topk: int, budget_bytes: int
) -> IndexerChunks:
    """Greedy, in token order: each chunk takes as many scored tokens as fit the budget."""
    seq = seq_lens.astype(np.int64)
    new = extend_lens.astype(np.int64)
    owner = np.repeat(np.arange(seq.shape[0]), new)
    start = np.repeat(np.cumsum(new) - new, new)
    causal = (seq - new)[owner] + (np.arange(owner.shape[0]) - start) + 1
    scored = np.flatnonzero(causal > topk)
    chunks = []
    # Runs of consecutive scored tokens: a chunk never spans a token taken whole.
    bounds = np.flatnonzero(np.diff(scored) != 1) + 1
    for run in np.split(scored, bounds) if scored.size else ():
        i = 0
        while i < run.shape[0]:
            widths = np.maximum.accumulate(causal[run[i:]])  # each row as wide as the widest
            padded = -(-widths // ROW_ALIGN) * ROW_ALIGN
            cost = np.arange(1, widths.shape[0] + 1) * padded * 4
            take = max(1, int(np.searchsorted(cost, budget_bytes, side="right")))
            first = int(run[i])
            chunks.append((first, first + take, int(widths[take - 1])))
            i += take
    return IndexerChunks(tuple(chunks), int(scored.shape[0]), int(owner.shape[0] - scored.shape[0]))


@indexer_chunks.provider("torch", graph_safe=False)
def _plan_chunks(
    out: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    extend_lens_cpu: torch.Tensor,
    *,
    topk: int,
    budget_bytes: int,
    static: bool,
) -> IndexerChunks:
    chunks = plan_chunks(seq_lens_cpu.numpy(), extend_lens_cpu.numpy(), topk, budget_bytes)
    largest = max(
        (
            (end - first) * -(-width // ROW_ALIGN) * ROW_ALIGN * 4
            for first, end, width in chunks.chunks
        ),
        default=0,
    )
    # Pinned, so the copy to a device plan is asynchronous: from pageable memory torch
    # synchronises the stream, and an eager extend plan would wait for queued GPU work.
    summary = torch.tensor(
        [len(chunks.chunks), chunks.scored, chunks.whole, largest],
        pin_memory=out.is_cuda,
    )
    out.copy_(summary, non_blocking=out.is_cuda)
    return chunks
