"""``LazyKernel.launch`` on CUDA: the direct launch through the compiled kernel's launcher
writes what Triton's run writes, per specialisation (index dtype, block sizes), on the
current stream, and steps aside for launch hooks."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import triton  # noqa: E402

from backends.common import torch_ref as ref  # noqa: E402
from backends.common import triton_kernels as tk  # noqa: E402


def _case(reqs: int, width: int, pages: int, index_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(-100, 10**6, (reqs + 3, max(width, 1)), generator=gen, dtype=torch.int32)
    pool = torch.randint(0, reqs + 3, (reqs,), generator=gen).to(index_dtype)
    lens = torch.randint(1, max(width, 1) + 1, (reqs,), generator=gen, dtype=torch.int32)
    return table.cuda(), pool.cuda(), lens.cuda()


def _fused(table, pool, lens, width, pages, page_size=64):
    """The token table's two Triton launches (slots, then pages), each a ``LazyKernel``."""
    slots = torch.full((pool.shape[0], width), -7, dtype=torch.int32, device="cuda")
    page = torch.full((pool.shape[0], pages), -7, dtype=torch.int32, device="cuda")
    tk.gather_token_slots(slots, table, pool, lens)
    tk.page_table_from_slots(page, slots, page_size)
    return slots, page


def _reference(table, pool, lens, width, pages, page_size=64):
    slots = torch.empty((pool.shape[0], width), dtype=torch.int32, device="cuda")
    page = torch.empty((pool.shape[0], pages), dtype=torch.int32, device="cuda")
    ref.gather_token_slots(slots, table, pool, lens)
    ref.page_table_from_slots(page, slots, page_size)
    return slots, page


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_direct_launches_equal_the_references_per_specialisation(index_dtype, monkeypatch):
    # nothing kept yet, whatever ran before in this process: the first launch of each
    # specialisation goes through Triton's run, the later ones directly
    monkeypatch.setattr(tk._gather_token_slots, "_compiled", {})
    shapes = [(1, 64, 1), (7, 4096, 64), (256, 1000, 16)]
    for seed, (reqs, width, pages) in enumerate(shapes):
        case = _case(reqs, width, pages, index_dtype, seed)
        for _ in range(3):  # the first may compile; the later ones launch directly
            got = _fused(*case, width, pages)
            want = _reference(*case, width, pages)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # one kept per specialisation (the block sizes here): every later launch was direct.
    # Were the installed Triton's compiled kernel no longer callable this way, nothing
    # would be kept and this fails: the direct launch reaches into Triton's internals.
    assert len(tk._gather_token_slots._compiled) >= 1


def test_launches_on_the_current_stream():
    case = _case(64, 4096, 64, torch.int64, 11)
    _fused(*case, 4096, 64)  # compiled and kept: the next launch is direct
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s queued before the launch on this stream
        got = _fused(*case, 4096, 64)
        done = torch.cuda.Event()
        done.record()
    assert not done.query()
    side.synchronize()
    want = _reference(*case, 4096, 64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_launch_hooks_send_launches_through_triton():
    case = _case(8, 256, 4, torch.int32, 5)
    _fused(*case, 256, 4)
    seen = []
    runtime = triton.knobs.runtime
    hook, before = (lambda metadata: seen.append(metadata)), runtime.launch_enter_hook
    if hasattr(before, "add"):  # a HookChain (Triton 3.5 and later)
        before.add(hook)
    else:
        runtime.launch_enter_hook = hook
    try:
        got = _fused(*case, 256, 4)
    finally:
        if hasattr(before, "remove"):
            before.remove(hook)
        else:
            runtime.launch_enter_hook = before
    assert len(seen) == 2  # Triton's run launched both, and called the hook
    want = _reference(*case, 256, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
