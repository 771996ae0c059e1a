"""The extend indexer's gather and slot selection compiled for the GPU (``backends.nsa.
extend_triton``), against their torch references on the same CUDA tensors; skipped cleanly
without CUDA. The interpreter tests (tests/backends/test_nsa_extend_triton.py) check the
addressing on the CPU; these check the compiled kernels, the dispatch that sends CUDA
tensors to them, and that a captured graph bounded by a larger KV reads the count each
replay (the graph's static length, a new count every replay).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from backends.deepgemm.fp8 import gather_index_cache  # noqa: E402
from backends.nsa.extend_attention import (  # noqa: E402
    gather_keys,
    select_slots,
    select_slots_reference,
)
from tests.support.extend_select_cases import random_cache, random_selection  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize(
    ("tokens", "topk", "flat"), [(1, 2048, 5000), (37, 2048, 9000), (5, 64, 70)]
)
def test_select_slots_equals_reference(tokens, topk, flat, scored):
    gen = torch.Generator().manual_seed(tokens * 7 + topk + scored)
    case = random_selection(gen, tokens, topk, flat, scored)
    want = select_slots_reference(*case, topk)
    got = select_slots(*(None if t is None else t.to(CUDA) for t in case), topk)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("n", [1, 63, 64, 5000])
def test_gather_keys_equal_reference_up_to_count(n):
    gen = torch.Generator().manual_seed(n)
    cache = random_cache(gen, 100, 128)
    slots = torch.randint(0, 100 * 64, (n,), generator=gen, dtype=torch.int32)
    want_keys, want_scales = gather_index_cache(cache, slots)
    for count in (n, n // 2, 0):
        keys, scales = gather_keys(
            cache.to(CUDA), slots.to(CUDA), torch.tensor([count], dtype=torch.int32, device=CUDA)
        )
        assert torch.equal(
            keys[:count].view(torch.uint8).cpu(), want_keys[:count].view(torch.uint8)
        )
        assert torch.equal(
            scales[:count].cpu().view(torch.int32), want_scales[:count].view(torch.int32)
        )


def test_gather_under_a_graph_reads_each_replays_count():
    gen = torch.Generator().manual_seed(1)
    cache = random_cache(gen, 50, 128).to(CUDA)
    slots = torch.zeros(3000, dtype=torch.int32, device=CUDA)  # a bound's static length
    count = torch.zeros(1, dtype=torch.int32, device=CUDA)
    keys, scales = gather_keys(cache, slots, count)  # warm-up: compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keys, scales = gather_keys(cache, slots, count)
    for real in (1000, 17, 3000):
        new = torch.randint(0, 50 * 64, (3000,), generator=gen, dtype=torch.int32)
        slots.copy_(new.to(CUDA))
        count.fill_(real)
        graph.replay()
        want_keys, want_scales = gather_index_cache(cache.cpu(), new[:real])
        assert torch.equal(keys[:real].view(torch.uint8).cpu(), want_keys.view(torch.uint8))
        assert torch.equal(scales[:real].cpu().view(torch.int32), want_scales.view(torch.int32))
