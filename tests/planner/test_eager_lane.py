"""The eager lane changes no behaviour: a planner with it and one without it accept, refuse
(same error, same field) and plan (bit-equal plans) exactly alike, on random and hostile
batches and on a decode growing a token a step (recycled memory, new layouts); the lane
takes every valid host decode and verify batch, sends nothing when it declines, and stands
aside in debug mode and for padded plans. Setups with host ops and host twins run them in
the lane too."""

from __future__ import annotations

import functools
import random
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import ForwardMode, PlanError, notices
from planner.compare import diff_plans
from tests.support.faults import break_host_twin, runtime_warnings
from tests.support.growing_decode import growing, small_planner
from tests.support.lane_cases import BS, CASES, HOSTILE, hostile_batches


def _without_lane(planner):
    """The planner with its eager lane off: every eager plan takes the general path."""
    planner._eager_lanes._next_n.clear()
    return planner


@functools.cache
def _pair(case: str):
    """A planner with the eager lane and one without it; the setup and mode."""
    setup, mode = CASES[case]
    return setup, setup.planner(), _without_lane(setup.planner()), mode


def _outcome(planner, batch):
    """What an eager plan did: the error's class and field, or the plans."""
    try:
        return planner.plan(batch)
    except PlanError as err:
        return type(err).__name__, err.field


def _same(fast, plain, batch) -> bool:
    """Both planners do the same with ``batch``; whether the lane planned it."""
    before = fast._eager_lanes.taken
    want, got = _outcome(plain, batch), _outcome(fast, batch)
    if isinstance(want, tuple):
        assert got == want
    else:
        assert not isinstance(got, tuple), got
        assert diff_plans(got, want) == []
        assert (got.phase, got.mode, got.reqs, got.real_reqs) == (
            want.phase,
            want.mode,
            want.reqs,
            want.real_reqs,
        )
    return fast._eager_lanes.taken == before + 1


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
@pytest.mark.parametrize("case", CASES)
def test_a_planner_with_the_lane_plans_as_one_without(case, hostile):
    """Every hostile change, at every batch size, with positions given and left out."""
    setup, fast, plain, mode = _pair(case)
    for batch in hostile_batches(setup, mode, fast.tokens_per_request(mode), hostile):
        taken = _same(fast, plain, batch)
        if hostile == "valid":
            assert taken, "a valid host batch must take the lane"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(sorted(CASES)),
    seed=st.integers(0, 10**6),
    bs=st.integers(1, BS),
    positions=st.booleans(),
)
def test_random_batches_plan_alike(case, seed, bs, positions):
    setup, fast, plain, mode = _pair(case)
    n = fast.tokens_per_request(mode)
    batch = setup.batch(random.Random(seed), bs=bs, next_n=n, mode=mode, positions=positions)
    assert _same(fast, plain, batch)


def test_a_growing_decode_plans_alike_over_recycled_memory():
    """A serving loop's decode: a new longest length every step (a new layout, the pool's
    views moved), plans dropped a step later (their memory recycled)."""
    fast, plain = small_planner(), _without_lane(small_planner())
    kept = []
    for batch in growing(40, bs=4, seed=7):
        assert _same(fast, plain, batch)
        kept = [fast.plan(batch)]  # the previous step's plans dropped here
    assert fast.storages.fresh(ForwardMode.DECODE, 4).pool.recycled > 0
    assert kept


@pytest.mark.parametrize("hostile", ["repeated slot", "wrong positions", "short pool"])
def test_a_batch_the_screen_refuses_sends_nothing_from_the_lane(hostile):
    """The lane declines (nothing sent): the screen refuses the first two, its door the
    third; the general path names the field."""
    setup, fast, plain, mode = _pair("nsa+paged decode")
    good = setup.batch(random.Random(2), bs=3, positions=True)
    bad = HOSTILE[hostile](good, setup.table)
    fast.plan(good)  # the lane of this size exists, its screen bound
    stager = fast.storages.fresh(mode, 3).stager
    before = stager.copies
    assert fast._eager_lanes.plan(bad) is None
    assert stager.copies == before
    with pytest.raises(PlanError) as err:
        fast.plan(bad)
    assert (type(err.value).__name__, err.value.field) == _outcome(plain, bad)


def test_debug_mode_and_padded_plans_take_the_general_path(monkeypatch):
    setup, fast, _, _ = _pair("nsa+paged decode")
    batch = setup.batch(random.Random(4), bs=2, positions=True)
    before = fast._eager_lanes.taken
    fast.plan(batch, pad_to=BS)
    monkeypatch.setattr(fast, "debug", True)
    fast.plan(batch)
    assert fast._eager_lanes.taken == before


def test_a_host_twin_that_fails_in_the_lane_is_retired_by_the_general_path(monkeypatch):
    """The lane sends nothing when a twin raises; the general path plans the batch again,
    retires the twin for good, and computes its field on the device; later batches take
    the lane without it. The plans are a device-only planner's throughout."""
    monkeypatch.setattr(notices, "_SAID", set())  # said once per process: said here
    calls = break_host_twin(monkeypatch)  # numpy twins alone, one that raises
    setup, mode = CASES["nsa+paged decode"]
    fast, reference = setup.planner(), setup.planner(eager_on_host=False)
    rng = random.Random(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            batch = setup.batch(rng, bs=BS, positions=True)
            assert diff_plans(fast.plan(batch), reference.plan(batch)) == []
            assert fast._eager_lanes.taken == step  # the first went the general way
    said = [m for m in runtime_warnings(caught) if "host twin failed" in m]
    assert len(said) == 1 and len(calls) == 1
