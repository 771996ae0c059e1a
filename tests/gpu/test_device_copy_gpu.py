"""The staging copy's runtime call on a real GPU: found in the process, exact, ordered on
the current stream behind earlier work, as ``copy_`` is."""

from __future__ import annotations

import pytest
import torch

from planner import device_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_runtime_call_is_found_and_taken():
    assert device_copy._memcpy_async() is not None
    assert device_copy.enabled()


@pytest.mark.parametrize("side_stream", [False, True])
def test_copies_land_in_order_behind_earlier_work(side_stream):
    index = torch.cuda.current_device()
    src = torch.arange(1000, dtype=torch.int32).pin_memory()
    dst = torch.full((1500,), -1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        dst.fill_(-2)  # queued before the copy on the same stream: the copy must land after
        device_copy.send(dst, src, 1000, index)
        got = dst.clone()
    torch.cuda.synchronize()
    assert torch.equal(got[:1000].cpu(), src)
    assert bool((got[1000:] == -2).all())
    assert device_copy.enabled()  # no failure retired it
