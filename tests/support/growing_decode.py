"""A small paged + nsa planner and the decode batches of a serving loop, whose lengths grow
by one token a step: what eager plans' layouts and recycled memory are tested on."""

from __future__ import annotations

import random

import torch

from planner import ForwardBatch, Limits, Planner
from tests.support.batches import make_pool

MAX_BATCH, MAX_CTX, PAGE = 6, 256, 64
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=4)


def small_planner(device: str = "cpu") -> Planner:
    limits = Limits(
        max_batch=MAX_BATCH,
        max_context=MAX_CTX,
        num_sms=8,
        kv_slots=int(TABLE.max()) + 1,
        device=device,
    )
    return Planner(["paged", "nsa"], limits, options={"nsa": {"topk": 16}})


_TABLES = {"cpu": TABLE}


def decode(lens: list[int], device: str = "cpu") -> ForwardBatch:
    seq = torch.tensor(lens, dtype=torch.int32)
    pool = torch.arange(1, len(lens) + 1, dtype=torch.int64)
    if device not in _TABLES:  # one device copy of the token table, as an engine keeps
        _TABLES[device] = TABLE.to(device)
    return ForwardBatch(
        seq_lens_cpu=seq,
        req_pool_indices=pool.to(device),
        req_to_token=_TABLES[device],
        out_cache_loc=TABLE[pool, (seq - 1).long()].to(device=device, dtype=torch.int64),
        positions=(seq - 1).to(device),
    )


def growing(steps: int, bs: int = 4, seed: int = 0, device: str = "cpu") -> list[ForwardBatch]:
    rng = random.Random(seed)
    start = [rng.randint(1, MAX_CTX - steps) for _ in range(bs)]
    return [decode([n + step for n in start], device) for step in range(steps)]
