"""Random, valid batches over a paged request pool, for the planner's tests."""

from __future__ import annotations

import random

import torch

from planner import ForwardBatch, ForwardMode


def make_pool(pool_size: int, max_context: int, page_size: int, seed: int = 0) -> torch.Tensor:
    """A req_to_token table: row 0 is the null request (all slot 0), others own shuffled pages."""
    rng = random.Random(seed)
    pages_per_req = -(-max_context // page_size)
    page_ids = list(range(1, 1 + (pool_size - 1) * pages_per_req))
    rng.shuffle(page_ids)
    table = torch.zeros(pool_size, max_context, dtype=torch.int32)
    offsets = torch.arange(page_size, dtype=torch.int32)
    for req in range(1, pool_size):
        pages = page_ids[(req - 1) * pages_per_req : req * pages_per_req]
        slots = (
            torch.tensor(pages, dtype=torch.int32)[:, None] * page_size + offsets[None, :]
        ).reshape(-1)
        table[req] = slots[:max_context]
    return table


def random_batch(
    rng: random.Random,
    table: torch.Tensor,
    *,
    max_batch: int,
    max_context: int,
    next_n: int = 1,
    mode: ForwardMode = ForwardMode.DECODE,
    bs: int | None = None,
    positions: bool = False,
) -> ForwardBatch:
    """A valid batch: distinct non-null requests with lengths in [next_n, max_context]."""
    n = next_n if mode is ForwardMode.TARGET_VERIFY else 1
    bs = bs or rng.randint(1, max_batch)
    reqs = rng.sample(range(1, table.shape[0]), bs)
    lens = [rng.randint(n, max_context) for _ in range(bs)]
    seq = torch.tensor(lens, dtype=torch.int32)
    pool = torch.tensor(reqs, dtype=torch.int64)
    cols = torch.tensor([[length - n + i for i in range(n)] for length in lens], dtype=torch.int64)
    loc = table[pool[:, None], cols].reshape(-1)
    pos = cols.reshape(-1).to(torch.int32) if positions else None
    return ForwardBatch(
        seq_lens_cpu=seq,
        req_pool_indices=pool,
        req_to_token=table,
        out_cache_loc=loc,
        positions=pos,
        mode=mode,
        next_n=n,
    )


def mode_for(next_n: int) -> ForwardMode:
    """Target verify for ``next_n`` > 1 (speculative tokens), decode otherwise."""
    return ForwardMode.TARGET_VERIFY if next_n > 1 else ForwardMode.DECODE


def modes_for(next_n: int) -> list[ForwardMode]:
    """The modes a planner of ``next_n`` serves: decode, and target verify when ``next_n`` > 1."""
    return [ForwardMode.DECODE] + ([ForwardMode.TARGET_VERIFY] if next_n > 1 else [])


def idle_batch(
    table: torch.Tensor, shape: ForwardMode = ForwardMode.DECODE, next_n: int = 1
) -> ForwardBatch:
    """A batch of no request over ``table``, shaped as ``shape`` with its tokens per request."""
    empty = torch.zeros(0, dtype=torch.int32)
    return ForwardBatch(
        seq_lens_cpu=empty,
        req_pool_indices=empty,
        req_to_token=table,
        out_cache_loc=empty,
        mode=ForwardMode.IDLE,
        next_n=next_n,
        idle_as=shape,
    )
