"""FlashInfer's host arrays (``HostArgs.fill``) against their definitions, on random batches:
the in-place numpy fill every replay runs must give what the plain formulas give."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.flashinfer.wrappers import HostArgs


@given(
    lens=st.lists(st.integers(1, 20000), min_size=1, max_size=9),
    pad=st.integers(0, 4),
    page=st.sampled_from([1, 16, 64]),
    next_n=st.integers(1, 4),
)
@settings(max_examples=80, deadline=None)
def test_fill_matches_the_definitions(lens, pad, page, next_n):
    args = HostArgs(capacity=16, pin=False)
    seq = torch.tensor([max(n, next_n) for n in lens], dtype=torch.int32)
    reqs = len(lens) + pad
    args.fill(torch.full((3,), 5, dtype=torch.int32), 3, page, 1)  # an earlier batch
    args.fill(seq, reqs, page, next_n)
    full = np.concatenate([seq.numpy(), np.full(pad, next_n)]).astype(np.int64)
    pages = (full + page - 1) // page
    assert args.kv_lens.tolist() == full.tolist()
    assert args.kv_indptr.tolist() == [0, *np.cumsum(pages).tolist()]
    assert args.last_page_len.tolist() == ((full - 1) % page + 1).tolist()
    assert args.qo_indptr.tolist() == [i * next_n for i in range(reqs + 1)]
    assert args.total_pages == int(pages.sum())
    assert args.summary.tolist() == [reqs, int(pages.sum()), int(full.sum()), int(full.max())]
