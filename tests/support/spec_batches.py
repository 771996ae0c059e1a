"""Random, valid speculative batches (verify, draft extend, draft decode) over a paged pool."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from planner import ForwardBatch, ForwardMode

I32 = torch.int32


def _requests(rng: random.Random, table: torch.Tensor, bs: int) -> list[int]:
    return rng.sample(range(1, table.shape[0]), bs)


def _index(rng: random.Random, values: list[int], typed: bool) -> torch.Tensor:
    return torch.tensor(values, dtype=rng.choice([I32, torch.int64]) if typed else I32)


def verify_batch(
    rng: random.Random,
    table: torch.Tensor,
    *,
    bs: int,
    max_context: int,
    next_n: int,
    lens: list[int] | None = None,
    typed: bool = False,
) -> ForwardBatch:
    """``next_n`` tokens per request (the last one and its drafts), KV lengths >= next_n."""
    reqs = _requests(rng, table, bs)
    lens = lens or [rng.randint(next_n, max_context) for _ in range(bs)]
    locs = [int(table[r, p]) for r, n in zip(reqs, lens) for p in range(n - next_n, n)]
    positions = [p for n in lens for p in range(n - next_n, n)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=I32),
        req_pool_indices=_index(rng, reqs, typed),
        req_to_token=table,
        out_cache_loc=_index(rng, locs, typed),
        positions=_index(rng, positions, typed) if rng.random() < 0.5 else None,
        mode=ForwardMode.TARGET_VERIFY,
        next_n=next_n,
    )


def draft_extend_batch(
    rng: random.Random,
    table: torch.Tensor,
    *,
    bs: int,
    max_context: int,
    next_n: int,
    accepted: list[int] | None = None,
    lens: list[int] | None = None,
    typed: bool = False,
) -> ForwardBatch:
    """Each request adds its accepted tokens (1..next_n, random unless given), flat."""
    reqs = _requests(rng, table, bs)
    accepted = accepted or [rng.randint(1, next_n) for _ in range(bs)]
    lens = lens or [rng.randint(a, max_context) for a in accepted]
    locs = [int(table[r, p]) for r, n, a in zip(reqs, lens, accepted) for p in range(n - a, n)]
    positions = [p for n, a in zip(lens, accepted) for p in range(n - a, n)]
    return ForwardBatch(
        seq_lens_cpu=torch.tensor(lens, dtype=I32),
        req_pool_indices=_index(rng, reqs, typed),
        req_to_token=table,
        out_cache_loc=_index(rng, locs, typed),
        positions=_index(rng, positions, typed) if rng.random() < 0.5 else None,
        mode=ForwardMode.DRAFT_EXTEND,
        next_n=next_n,
        extend_lens_cpu=torch.tensor(accepted, dtype=I32),
    )


def draft_decode_batch(
    rng: random.Random,
    table: torch.Tensor,
    *,
    bs: int,
    max_context: int,
    steps: int,
    lens: list[int] | None = None,
    typed: bool = False,
) -> ForwardBatch:
    """``steps`` one-token draft steps per request: KV lengths after the last step, every
    step's slot and position, request-major."""
    batch = verify_batch(
        rng, table, bs=bs, max_context=max_context, next_n=steps, lens=lens, typed=typed
    )
    return replace(batch, mode=ForwardMode.DRAFT_DECODE)
