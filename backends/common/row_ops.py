"""Row-layout ops of speculative batches: ``next_n`` query rows per request, some of them padding.

A draft-extend batch gives each request's accepted tokens (``e`` of them,
1..``next_n``) flat, request-major; graphs need static shapes, so the planner
spreads them over ``next_n`` rows per request (row ``b * next_n + i``), and
rows ``i >= e`` are padding: they hold the schema's pad values and the layers
mask them. An expanded verify (a kernel that cannot take ``next_n`` rows per
request) repeats each request's table row once per query row.

Every op is graph-safe: shapes come from tensor metadata only, results land in
``out``, no device value is read back. These torch providers are the exact
references (and the only providers: each op is a handful of element-wise
tensor ops, fused by nothing worth a kernel of its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from planner.ops import metadata_op

I32 = torch.int32


def _row_index(n: int, like: torch.Tensor) -> torch.Tensor:
    """``[1, n]`` row offsets within a request."""
    return torch.arange(n, dtype=I32, device=like.device).unsqueeze(0)


def _times_one(params: Mapping[str, Any]) -> bool:
    return params.get("times") == 1


repeat_rows = metadata_op(
    "repeat_rows",
    "out[r * times + j] = x[r]: each row of a per-request table once per query row "
    "(an expanded verify's block table); the input itself when times is 1.",
    identity=_times_one,
)
accepted_causal_lengths = metadata_op(
    "accepted_causal_lengths",
    "out[b*n + i] = seq_lens[b] - e[b] + i + 1 for i < e[b], else pad: the causal KV length "
    "of each accepted token's row, from the accepted counts (not the next_n staircase).",
)
spread_rows = metadata_op(
    "spread_rows",
    "out[b*n + i] = values[qo_indptr[b] + i] for i < e[b], else pad: a flat per-token input "
    "laid out over next_n rows per request.",
)
row_tokens = metadata_op(
    "row_tokens",
    "out[b*n + i] = qo_indptr[b] + min(i, e[b] - 1): the flat token each row reads its "
    "inputs from (padding rows repeat the request's last token, then are masked).",
)
row_mask = metadata_op(
    "row_mask", "out[b*n + i] = 1 if i < e[b] else 0: which rows hold an accepted token."
)
last_accepted_rows = metadata_op(
    "last_accepted_rows",
    "out[b] = b * n + e[b] - 1: the row of each request's last accepted token (its logits "
    "and hidden state are the draft's next input).",
)


@repeat_rows.provider("torch")
def _repeat_rows(out: torch.Tensor, x: torch.Tensor, times: int) -> None:
    out.view(x.shape[0], times, *x.shape[1:]).copy_(x.unsqueeze(1))


@accepted_causal_lengths.provider("torch")
def _accepted_causal_lengths(
    out: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor, next_n: int, pad: int
) -> None:
    i = _row_index(next_n, out)
    e = extend_lens.unsqueeze(1)
    lens = seq_lens.unsqueeze(1) - e + i + 1
    out.view(-1, next_n).copy_(torch.where(i < e, lens, torch.full_like(lens, pad)))


@spread_rows.provider("torch")
def _spread_rows(
    out: torch.Tensor,
    values: torch.Tensor,
    qo_indptr: torch.Tensor,
    extend_lens: torch.Tensor,
    next_n: int,
    pad: int,
) -> None:
    i = _row_index(next_n, out)
    e = extend_lens.unsqueeze(1)
    flat = (qo_indptr[:-1].unsqueeze(1) + i).clamp(max=values.shape[0] - 1).long()
    picked = values[flat]
    out.view(-1, next_n).copy_(torch.where(i < e, picked, torch.full_like(picked, pad)))


@row_tokens.provider("torch")
def _row_tokens(
    out: torch.Tensor, qo_indptr: torch.Tensor, extend_lens: torch.Tensor, next_n: int
) -> None:
    i = _row_index(next_n, out)
    last = (extend_lens - 1).unsqueeze(1)
    out.view(-1, next_n).copy_(qo_indptr[:-1].unsqueeze(1) + torch.minimum(i, last))


@row_mask.provider("torch")
def _row_mask(out: torch.Tensor, extend_lens: torch.Tensor, next_n: int) -> None:
    i = _row_index(next_n, out)
    out.view(-1, next_n).copy_((i < extend_lens.unsqueeze(1)).to(I32))


@last_accepted_rows.provider("torch")
def _last_accepted_rows(out: torch.Tensor, extend_lens: torch.Tensor, next_n: int) -> None:
    b = torch.arange(extend_lens.shape[0], dtype=I32, device=out.device)
    out.copy_(b * next_n + extend_lens - 1)
