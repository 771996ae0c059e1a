"""Stepped batches: a draft-decode batch is ``k`` decode batches, one KV token longer each.

A draft model proposing ``k`` tokens runs ``k`` one-token forwards, step ``s``
attending over one more KV token than step ``s - 1``. Upstream engines plan
these once per batch for all steps and share the metadata; planning them per
step from lengths the engine recomputes by hand is where off-by-ones creep in.
Here the engine hands over one batch shaped like a verify (``next_n = k``
tokens per request, KV lengths after the last step, every step's slot) and
the planner derives the steps: step ``s`` of request ``b`` has KV length
``seq_lens[b] - (k - 1 - s)``, slot and position of token ``b * k + s``.
Each step is planned by the decode program, into its own buffers, in the same
planner call (one staging copy for all steps, every op inside the graph), so
step ``s``'s layers read a decode plan of their own, equal bit for bit to
planning that step's batch alone.
"""

from __future__ import annotations

import torch

from planner.batch import ForwardBatch, ForwardMode

STEP_SEP = "@"
"""A stepped plan set names step ``s`` of backend ``b`` ``b@s`` when flattened (dumps, diffs)."""


def step_key(backend: str, step: int) -> str:
    return f"{backend}{STEP_SEP}{step}"


def base_backend(key: str) -> str:
    """``nsa`` for ``nsa@2`` (and for ``nsa``): whose schema and pads a flattened plan has."""
    return key.split(STEP_SEP, 1)[0]


def _column(tensor: torch.Tensor | None, bs: int, k: int, s: int) -> torch.Tensor | None:
    if tensor is None:
        return None
    return tensor.view(bs, k)[:, s].contiguous()


def step_batches(batch: ForwardBatch) -> list[ForwardBatch]:
    """The ``k = batch.next_n`` decode batches of a draft-decode batch, step 0 first.

    The batch was checked at the door (``seq_lens_cpu >= k``, ``k`` tokens per
    request); the steps' own values are range-checked where they are staged.
    """
    k, bs = batch.next_n, batch.bs
    positions = batch.source("positions")
    steps = []
    for s in range(k):
        lens = batch.seq_lens_cpu - (k - 1 - s)
        steps.append(
            ForwardBatch(
                seq_lens_cpu=lens,
                req_pool_indices=batch.req_pool_indices,
                req_to_token=batch.req_to_token,
                out_cache_loc=_column(batch.out_cache_loc, bs, k, s),
                positions=_column(positions, bs, k, s),
                seq_lens=None if batch.seq_lens is None else batch.seq_lens - (k - 1 - s),
                mode=ForwardMode.DECODE,
                next_n=1,
            )
        )
    return steps


def batches_of(batch: ForwardBatch) -> list[ForwardBatch]:
    """What a batch plans as: its steps when stepped, else itself."""
    return step_batches(batch) if ForwardMode(batch.mode).stepped else [batch]
