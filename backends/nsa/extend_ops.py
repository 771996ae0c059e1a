"""The extend indexer's static chunking: how many query tokens one ``fp8_mqa_logits`` call scores.

The ragged indexer (deep_gemm's ``fp8_mqa_logits``) writes one fp32 score per query token
and KV token it reads: a 16k-token prefill over a 16k context is a gigabyte, so the tokens
are scored in chunks whose logits fit a budget (the ``indexer_logits_bytes`` setting).
For a CUDA graph the chunks must not depend on the batch's values, so they are cut from
shapes and plan scalars alone:

- every query token is scored, in chunks of ``C`` consecutive tokens (the last one shorter),
  ``C = max(1, budget // (align(W, 256) * 4))`` (:func:`indexer_chunk_rows`);
- every row is ``W = max_seq_len`` columns wide (deep_gemm's compressed ``max_seqlen_k``
  layout, rows padded to 256 columns): the longest request's KV, which covers every token's
  causal range. In an eager plan ``W`` is the batch's; in a captured one the static bound,
  so the graph's chunks serve every batch it replays;
- a token whose causal KV length is at most ``topk`` still takes all its KV (the engines'
  "skip the indexer when the KV fits"): the layer selects it per row with ``torch.where``.
  When ``W <= topk`` no token can be scored, and the layer scores nothing (a plan scalar,
  so a graph decides it at capture).

``C`` is a derived dimension of :class:`~backends.nsa.extend_plan.NSAExtendPlan`
(``indexer_chunk_rows``, a plan scalar): a pure function of ``max_len`` and the budget,
as the sparse MLA split count is of the rows. A row's scores do not depend on its chunk
or on ``W`` (columns past its range are never read: ``row_topk`` is length-aware), so the
top-k is what scoring only the long tokens in value-dependent chunks gave.

Cost (computed, not measured: DeepSeek-V3.2's 64 index heads x 128, top-k 2048, per
layer). Scoring the tokens that fit (positions < 2048) adds ``2 * 64 * 128`` FLOPs and 4
written bytes per (token, causal KV token) pair. A 1,024-token chunk at positions
0-1023: 524,800 pairs, 8.6 GFLOP and 2.0 MiB of scores where none were computed (at
1024-2047: 25.8 GFLOP; a chunk at 2048-3071 is scored either way, 43.0 GFLOP). A 64-token
chunk at 0-63: 2,080 pairs, 34 MFLOP (each decode row of a mixed batch under 2048 KV adds
up to 2048 pairs, 34 MFLOP). Eager plans whose longest KV fits score nothing, as before; in a
graph the buffer is ``tokens x align(W, 256) x 4`` bytes per chunk, e.g. 32 MiB for 1,024
tokens and 2 MiB for 64 at W = 8192, of which only the pairs above are written and read.
"""

from __future__ import annotations

ROW_ALIGN = 256
"""deep_gemm pads each compressed logits row to a multiple of 256 columns."""

LOGIT_BYTES = 4
"""fp32 logits."""


def indexer_row_bytes(width: int) -> int:
    """Bytes one compressed logits row of ``width`` columns takes (padded to 256 columns)."""
    return -(-max(width, 0) // ROW_ALIGN) * ROW_ALIGN * LOGIT_BYTES


def indexer_chunk_rows(width: int, budget_bytes: int) -> int:
    """Query tokens one indexer chunk scores: as many ``width``-column rows as fit the
    budget, at least one (a row wider than the budget is scored alone)."""
    row = indexer_row_bytes(width)
    return max(1, budget_bytes // row) if row else 1


def indexer_chunk_bounds(tokens: int, rows: int) -> list[tuple[int, int]]:
    """``(first, end)`` of each chunk of ``rows`` tokens over ``tokens`` query tokens, in
    order, the last one shorter: what the layer walks, from the shape alone."""
    return [(first, min(first + rows, tokens)) for first in range(0, tokens, rows)]
