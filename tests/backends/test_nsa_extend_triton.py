"""The extend indexer's gather and slot selection (``backends.nsa.extend_triton``) under the
Triton interpreter, against their torch references on random inputs; compiled on the GPU in
tests/gpu/test_nsa_extend_triton_gpu.py.

The claims: the selection equals ``select_slots_reference`` entry for entry, with and
without scored tokens; the gather writes exactly the first ``min(count, N)`` entries, equal
to ``gather_index_cache``'s, and leaves every entry past them as it was.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.deepgemm.fp8 import as_words, gather_index_cache, index_cache_views
from backends.nsa.extend_attention import select_slots_reference
from backends.nsa.extend_triton import gather_index_keys_triton, select_slots_triton
from tests.support.extend_select_cases import random_cache, random_selection

pytestmark = pytest.mark.triton


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(0, 12),
    topk=st.sampled_from([1, 3, 8, 33]),
    flat=st.integers(1, 90),
    scored=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_select_slots_equals_reference(tokens, topk, flat, scored, seed):
    gen = torch.Generator().manual_seed(seed)
    case = random_selection(gen, tokens, topk, flat, scored)
    want = select_slots_reference(*case, topk)
    got = select_slots_triton(*case, topk)
    assert got.dtype == torch.int32 and got.shape == (tokens, topk)
    assert torch.equal(got, want)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(0, 150),
    extra=st.integers(-160, 4),
    dim=st.sampled_from([32, 128]),
    seed=st.integers(0, 2**16),
)
def test_gather_writes_the_count_and_nothing_past_it(n, extra, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    pages = 3
    cache = random_cache(gen, pages, dim)
    slots = torch.randint(0, pages * 64, (n,), generator=gen, dtype=torch.int32)
    count = max(n + extra, 0)  # past n too: the kernel stops at n
    k_view, s_view = index_cache_views(cache)
    words = as_words(k_view)
    keys = torch.full((n, words.shape[-1]), 7, dtype=words.dtype)
    scales = torch.full((n,), 3.5)
    gather_index_keys_triton(
        words, s_view, slots, torch.tensor([count], dtype=torch.int32), keys, scales
    )
    want_keys, want_scales = gather_index_cache(cache, slots)
    live = min(count, n)
    got_keys = keys.view(torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(got_keys[:live].view(torch.uint8), want_keys[:live].view(torch.uint8))
    assert torch.equal(scales[:live].view(torch.int32), want_scales[:live].view(torch.int32))
    assert bool((keys[live:] == 7).all()) and bool((scales[live:] == 3.5).all())
