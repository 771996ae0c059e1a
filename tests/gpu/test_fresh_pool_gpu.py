"""Recycled eager memory on a real GPU: taken back only on the stream it was handed out on,
behind the work queued there that reads it; plans stay exact; a held plan stays intact."""

from __future__ import annotations

import pytest
import torch

from planner import ForwardMode
from planner.compare import diff_plans
from tests.support.growing_decode import decode, growing, small_planner
from tests.support.plan_holders import HOLDERS, OTHERS, A, fields_of, tensor_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pool(planner):
    return planner.storages.fresh(ForwardMode.DECODE, 3).pool


def test_a_growing_loop_recycles_and_stays_exact():
    planner = small_planner("cuda")
    held = None
    for batch in growing(16, bs=3, seed=5, device="cuda"):
        held = planner.plan(batch)
        assert diff_plans(held, small_planner("cuda").plan(batch)) == []
    assert _pool(planner).recycled >= 12


def test_work_queued_on_the_stream_reads_the_old_plan_first():
    planner = small_planner("cuda")
    plans = planner.plan(decode(A, "cuda"))
    field = ("nsa", "page_table")
    expected = tensor_of(plans, field).clone()
    torch.cuda._sleep(50_000_000)  # the read below waits behind this on the stream
    read = tensor_of(plans, field).clone()
    before = _pool(planner).recycled
    del plans
    planner.plan(decode(OTHERS[0], "cuda"))  # same layout: takes the memory back at once
    assert _pool(planner).recycled == before + 1
    torch.cuda.synchronize()
    assert torch.equal(read, expected)


def test_memory_handed_out_on_another_stream_is_not_taken_back():
    planner = small_planner("cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        planner.plan(decode(A, "cuda"))
    side.synchronize()
    before = _pool(planner).recycled
    got = planner.plan(decode(OTHERS[0], "cuda"))
    assert _pool(planner).recycled == before
    assert diff_plans(got, small_planner("cuda").plan(decode(OTHERS[0], "cuda"))) == []


@pytest.mark.parametrize("how", [h for h in HOLDERS if h != "a numpy array of it"])
def test_memory_still_readable_is_never_written(how):
    planner = small_planner("cuda")
    for field in fields_of(planner.plan(decode(A, "cuda"))):
        plans = planner.plan(decode(A, "cuda"))
        hold, part = HOLDERS[how]
        expected = part(tensor_of(plans, field)).clone()
        holder, read = hold(plans, field)
        del plans
        for lens in OTHERS:
            planner.plan(decode(lens, "cuda"))
        assert torch.equal(read(), expected), f"{field} held by {how} was overwritten"
        del holder, read
