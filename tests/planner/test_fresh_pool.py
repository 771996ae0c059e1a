"""Eager plans' memory is recycled only once nothing can read it.

An eager plan owns its tensors: a later plan must never write memory that any tensor of
it, or anything made from one, can still read. Within that, a serving loop that drops
each step's plans gets the memory of an earlier step back, with its views already cut.
Every holder below is a way a user keeps plan memory readable; each must keep it intact
while batches of other values are planned.
"""

from __future__ import annotations

import gc

import pytest
import torch

from planner import ForwardMode
from planner.compare import diff_plans
from planner.fresh_pool import FreshPool
from tests.support.growing_decode import decode, growing, small_planner
from tests.support.plan_holders import HOLDERS, OTHERS, A, fields_of, tensor_of


def _pool(planner, reqs: int = 3) -> FreshPool:
    return planner.storages.fresh(ForwardMode.DECODE, reqs).pool


@pytest.mark.parametrize("how", list(HOLDERS))
def test_memory_still_readable_is_never_written(how):
    planner = small_planner()
    fields = fields_of(planner.plan(decode(A)))
    gc.collect()
    for field in fields:
        plans = planner.plan(decode(A))
        hold, part = HOLDERS[how]
        expected = part(tensor_of(plans, field)).clone()
        holder, read = hold(plans, field)
        del plans
        for lens in OTHERS:
            planner.plan(decode(lens))  # dropped at once: their memory may be recycled
        assert torch.equal(read(), expected), f"{field} held by {how} was overwritten"
        del holder, read


def test_a_dropped_plans_memory_comes_back():
    planner = small_planner()
    planner.plan(decode(A))
    pool = _pool(planner)
    before = pool.recycled
    for lens in OTHERS:
        got = planner.plan(decode(lens))
        assert diff_plans(got, small_planner().plan(decode(lens))) == []
        del got
    assert pool.recycled == before + len(OTHERS)


def test_a_loop_that_keeps_the_last_step_alternates_two_buffers():
    """A loop plans step n+1 while step n's plans are still bound: two buffers take turns."""
    planner = small_planner()
    held, starts = None, set()
    for batch in growing(20, bs=3, seed=2):
        held = planner.plan(batch)
        starts.add(min(t.data_ptr() for p in held.values() for t in p.tensors().values()))
        assert diff_plans(held, small_planner().plan(batch)) == []
    pool = _pool(planner)
    assert pool.recycled >= 17
    assert len(starts) <= 3  # two taking turns, a third where the buffer had to grow


def test_plans_held_by_the_caller_are_not_recycled():
    planner = small_planner()
    kept = [planner.plan(decode(A))]
    pool = _pool(planner)
    before = pool.recycled
    for lens in OTHERS:
        kept.append(planner.plan(decode(lens)))
    assert pool.recycled == before
    for plans, lens in zip(kept, [A, *OTHERS]):
        assert diff_plans(plans, small_planner().plan(decode(lens))) == []


def test_memory_past_the_budget_is_not_kept(monkeypatch):
    monkeypatch.setattr("planner.fresh_pool.POOL_BYTES", 64)
    planner = small_planner()
    for lens in [A, *OTHERS]:
        got = planner.plan(decode(lens))
        assert diff_plans(got, small_planner().plan(decode(lens))) == []
        del got
    pool = _pool(planner)
    assert pool.recycled == 0
    assert pool.nbytes == 0


def test_recycled_views_are_laid_out_as_fresh_ones():
    """Same shapes, strides and contiguity as a plan in new memory, shape after shape."""
    planner = small_planner()
    for batch in growing(12, bs=3, seed=7):
        got, fresh = planner.plan(batch), small_planner().plan(batch)
        for field in fields_of(fresh):
            a, b = tensor_of(got, field), tensor_of(fresh, field)
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), field
            assert a.is_contiguous(), field
    assert _pool(planner).recycled >= 9


def test_kept_parts_are_bounded(monkeypatch):
    """Ragged batches make a staged part per token count: the longest unused go first."""
    monkeypatch.setattr("planner.fresh_pool.PARTS", 2)
    planner = small_planner()
    planner.plan(decode(A))
    storage = planner.storages.fresh(ForwardMode.DECODE, 3)
    pool = storage.pool
    parts = []
    for tokens in (1, 2, 3):  # a ragged batch of fewer tokens than requests, made up
        layout = storage._layout(planner.dims(ForwardMode.DECODE, 3, 100, tokens, 170), 3, None)
        assert pool.take(layout) is not None
        parts.append(id(layout.part))
    assert list(pool._parts) == parts[-2:]
    assert pool.nbytes == sum(e.nbytes for es in pool._parts.values() for e in es)
