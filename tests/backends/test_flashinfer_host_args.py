"""FlashInfer's host arrays (``HostArgs.fill``) against their definitions, on random batches:
the in-place numpy fill every replay runs must give what the plain formulas give."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.flashinfer.host_args import HostArgs
from planner.errors import ProviderError


@given(
    lens=st.lists(st.integers(1, 20000), min_size=1, max_size=9),
    pad=st.integers(0, 4),
    page=st.sampled_from([1, 16, 64]),
    next_n=st.integers(1, 4),
    earlier=st.integers(1, 12),
    earlier_n=st.integers(1, 2),
)
@settings(max_examples=120, deadline=None)
def test_fill_matches_the_definitions(lens, pad, page, next_n, earlier, earlier_n):
    """After an earlier batch of another size or mode: nothing of it is left behind."""
    args = HostArgs(capacity=16, pin=False)
    seq = torch.tensor([max(n, next_n) for n in lens], dtype=torch.int32)
    reqs = len(lens) + pad
    args.fill(torch.full((earlier,), 9, dtype=torch.int32), earlier, page, earlier_n)
    args.fill(seq, reqs, page, next_n)
    full = np.concatenate([seq.numpy(), np.full(pad, next_n)]).astype(np.int64)
    pages = (full + page - 1) // page
    assert args.kv_lens.tolist() == full.tolist()
    assert args.kv_indptr.tolist() == [0, *np.cumsum(pages).tolist()]
    assert args.last_page_len.tolist() == ((full - 1) % page + 1).tolist()
    assert args.qo_indptr.tolist() == [i * next_n for i in range(reqs + 1)]
    assert args.total_pages == int(pages.sum())
    assert args.summary.tolist() == [reqs, int(pages.sum()), int(full.sum()), int(full.max())]


def test_lengths_of_another_dtype_or_layout_are_read_as_int32():
    """int64 lengths, or a strided view, fill the same arrays as contiguous int32 ones."""
    want = HostArgs(8, pin=False)
    want.fill(torch.tensor([5, 70, 129, 1], dtype=torch.int32), 6, 64, 1)
    base = torch.tensor([5, 70, 129, 1], dtype=torch.int64)
    strided = torch.tensor([5, 0, 70, 0, 129, 0, 1, 0], dtype=torch.int32)[::2]
    for seq in (base, strided):
        args = HostArgs(8, pin=False)
        args.fill(seq, 6, 64, 1)
        assert args.kv_lens.tolist() == [5, 70, 129, 1, 1, 1]
        for name in ("qo_indptr", "kv_indptr", "last_page_len", "kv_lens", "summary"):
            assert torch.equal(getattr(args, name), getattr(want, name)), name


def test_a_batch_past_the_capacity_is_refused_naming_the_field():
    with pytest.raises(ProviderError, match="seq_lens_cpu"):
        HostArgs(4, pin=False).fill(torch.ones(5, dtype=torch.int32), 5, 64, 1)
