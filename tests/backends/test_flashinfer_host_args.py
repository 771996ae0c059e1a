"""FlashInfer's host arrays (``HostArgs.fill``) against their definitions, on random batches:
the in-place numpy fill must give what the plain formulas give, and the compiled fill every
replay runs what the numpy fill gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.flashinfer import host_args
from backends.flashinfer.host_args import HostArgs
from planner.errors import ProviderError


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


needs_c = pytest.mark.skipif(
    host_args._c_fill() is None, reason="no C compiler here: the compiled fill is not built"
)


def _arrays(args: HostArgs) -> list[list[int]]:
    return [
        t.tolist()
        for t in (args.qo_indptr, args.kv_indptr, args.last_page_len, args.kv_lens, args.summary)
    ]


@needs_c
@given(
    lens=st.lists(st.integers(-3, 40000), min_size=1, max_size=12),
    pad=st.integers(0, 4),
    page=st.sampled_from([1, 16, 64]),
    next_n=st.integers(1, 4),
    earlier=st.integers(1, 12),
)
@settings(max_examples=150, deadline=None)
def test_compiled_fill_writes_what_numpy_writes(lens, pad, page, next_n, earlier):
    """Lengths below 1 included: the C fill declines them and numpy runs, so both agree."""
    compiled, plain = HostArgs(16, pin=False), HostArgs(16, pin=False, compiled=False)
    seq = torch.tensor(lens, dtype=torch.int32)
    reqs = len(lens) + pad
    for args in (compiled, plain):
        args.fill(torch.full((earlier,), 9, dtype=torch.int32), earlier, page, 2)
        args.fill(seq, reqs, page, next_n)
    assert _arrays(compiled) == _arrays(plain)


@needs_c
def test_inputs_the_compiled_fill_cannot_read_go_to_numpy():
    base = torch.tensor([5, 70, 129, 1], dtype=torch.int64)
    strided = torch.tensor([5, 0, 70, 0, 129, 0, 1, 0], dtype=torch.int32)[::2]
    for seq in (base, strided):
        compiled, plain = HostArgs(8, pin=False), HostArgs(8, pin=False, compiled=False)
        compiled.fill(seq, 6, 64, 1)
        plain.fill(seq, 6, 64, 1)
        assert _arrays(compiled) == _arrays(plain)
        assert compiled.kv_lens.tolist() == [5, 70, 129, 1, 1, 1]


def test_a_batch_past_the_capacity_is_refused_naming_the_field():
    with pytest.raises(ProviderError, match="seq_lens_cpu"):
        HostArgs(4, pin=False).fill(torch.ones(5, dtype=torch.int32), 5, 64, 1)
