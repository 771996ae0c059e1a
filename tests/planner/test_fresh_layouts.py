"""Eager plans in a real decode loop: every step's lengths grow by one, so the longest
request (and with it the token slots' width) changes every step, and the plans stay the
plans a planner that never saw an earlier batch makes."""

from __future__ import annotations

import pytest

from planner import ForwardMode
from planner.debug import diff_plans
from planner.errors import SchemaError
from tests.support.growing_decode import decode as _decode
from tests.support.growing_decode import growing as _growing
from tests.support.growing_decode import small_planner as _planner


def test_growing_plans_equal_a_fresh_planners():
    planner = _planner()
    for batch in _growing(10, seed=1):
        got = planner.plan(batch)
        assert diff_plans(got, _planner().plan(batch)) == []


def test_a_growing_batch_of_other_sizes_and_modes_stays_exact():
    """Request counts and modes each get their own shapes (a verify step's rows differ)."""
    planner = _planner()
    for bs in (1, 3, 6):
        for batch in _growing(4, bs=bs, seed=bs):
            assert diff_plans(planner.plan(batch), _planner().plan(batch)) == []


def test_a_dimension_a_shape_names_but_the_batch_lacks_is_named():
    planner = _planner()
    batch = _decode([100, 50, 20])
    dims = planner.dims(ForwardMode.DECODE, 3, 100, 3, 170)
    del dims["max_len"]
    with pytest.raises(SchemaError, match="unknown dimension 'max_len'") as caught:
        planner.storages.fresh(ForwardMode.DECODE).stage(batch, 3, dims)
    assert caught.value.field == "paged.token_slots"
