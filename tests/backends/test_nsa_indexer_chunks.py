"""The prefill indexer's chunking against the obvious token-by-token greedy, on random batches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from backends.nsa.extend_ops import ROW_ALIGN, plan_chunks


def greedy(seq: list[int], new: list[int], topk: int, budget: int) -> list[tuple[int, int, int]]:
    """Walk the tokens in order; a chunk grows while its rows (as wide as the widest, padded
    to 256 columns, 4 bytes each) fit the budget, and ends at a token taken whole."""
    causal = [n - e + i + 1 for n, e in zip(seq, new) for i in range(e)]
    chunks, open_ = [], None  # open_: [first, end, width]
    for t, c in enumerate(causal):
        if c <= topk:
            if open_:
                chunks.append(tuple(open_))
            open_ = None
            continue
        if open_:
            width = max(open_[2], c)
            rows = t + 1 - open_[0]
            if rows * (-(-width // ROW_ALIGN) * ROW_ALIGN) * 4 <= budget:
                open_[1], open_[2] = t + 1, width
                continue
            chunks.append(tuple(open_))
        open_ = [t, t + 1, c]
    if open_:
        chunks.append(tuple(open_))
    return chunks


@pytest.mark.parametrize("seed", range(30))
def test_chunks_equal_the_token_by_token_greedy(seed):
    rng = random.Random(seed)
    reqs = rng.randint(1, 6)
    seq = [rng.randint(1, 3000) for _ in range(reqs)]
    new = [rng.randint(1, n) for n in seq]
    topk = rng.choice([1, 64, 512, 2048])
    budget = rng.choice([1, 4096, 1 << 16, 1 << 20, 1 << 30])
    got = plan_chunks(np.array(seq), np.array(new), topk, budget)
    assert list(got.chunks) == greedy(seq, new, topk, budget)
    assert got.scored + got.whole == sum(new)
