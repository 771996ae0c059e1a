"""The replay hot path's cheaper checks refuse exactly what the plain ones they replace do.

Each fast check here is a screen in front of the plain one (the staging range pass, the
int64-to-int32 fit, the door's host-device test, the moved-tensor check, positions left out
of a uniform batch): compared with the plain version on random and edge inputs.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from planner import BatchError, ForwardMode, ReplayError
from planner.checks import ElementBounds
from planner.staging import _INT32, _fits_int32, input_ranges
from tests.support.planners import PlannerSetup

SETUP = PlannerSetup(("nsa", "paged"), max_batch=4, max_context=256, page_size=64)
VERIFY = PlannerSetup(
    ("nsa", "paged"), max_batch=4, max_context=256, page_size=64, limits={"next_n": 2}
)
I32_MIN, I32_MAX = _INT32


def _ranges():
    return input_ranges(256, 1, None, SETUP.table, ragged=False)


@pytest.mark.parametrize("seed", range(6))
def test_the_one_pass_range_check_equals_two_comparisons(seed):
    """Unsigned ``value - lo > hi - lo`` (int32 bounds) against ``value < lo or value > hi``
    (int64 bounds), ranges past int32 and empty ones included; the same first bad index."""
    rng = np.random.default_rng(seed)
    size = [1, 7, 320, 1280, 5000, 64][seed]
    edges = np.array([I32_MIN, I32_MIN + 1, -1, 0, 1, I32_MAX - 1, I32_MAX], np.int64)
    for trial in range(60):
        lo = rng.choice(np.concatenate([edges, rng.integers(-50, 50, 8), [-(2**40)]]), size)
        hi = lo + rng.choice([0, 1, 5, 2**31, 2**33, -1], size)  # -1: an empty range
        if trial % 4 == 0:
            hi = np.maximum(hi, lo)  # every range holds a value: the one-pass path
        if trial % 6 == 0:
            lo[:], hi[:] = I32_MIN, I32_MAX  # nothing checked
        flat = rng.choice(np.concatenate([edges, rng.integers(-60, 60, 16)]), size)
        flat = flat.astype(np.int32)
        if trial % 3 == 0:
            flat = np.clip(flat, lo, hi).astype(np.int32)  # all in range where ranges hold
        bad = (flat < lo) | (flat > hi)
        for one_pass in (True, False):
            bounds = ElementBounds(lo.copy(), hi.copy(), None, one_pass=one_pass)
            assert bounds.outside(flat) == bool(bad.any())
            if bad.any():
                assert bounds.first_outside(flat) == int(np.flatnonzero(bad)[0])


def _fits_int32_plain(source, values, ranges):
    """The check before its one-reduction screen."""
    low, high = int(values.min()), int(values.max())
    if low < I32_MIN or high > I32_MAX:
        lo, hi = ranges[source]
        raise BatchError(
            "value out of range",
            field=source,
            expected=f"[{lo}, {hi}]",
            actual=low if low < I32_MIN else high,
        )


@pytest.mark.parametrize("size", [1, 2, 64, 300])
def test_the_int32_fit_screen_refuses_exactly_what_min_and_max_do(size):
    rng = np.random.default_rng(size)
    special = np.array(
        [0, 1, -1, I32_MAX, I32_MAX + 1, I32_MIN, I32_MIN - 1, 2**32 + 5, -(2**40), 2**62],
        np.int64,
    )
    ranges = _ranges()
    for trial in range(150):
        values = rng.integers(0, 1000, size, dtype=np.int64)
        for _ in range(trial % 3):
            values[rng.integers(0, size)] = rng.choice(special)
        want = got = None
        try:
            _fits_int32_plain("out_cache_loc", values, ranges)
        except BatchError as err:
            want = str(err)
        try:
            _fits_int32("out_cache_loc", values, ranges)
        except BatchError as err:
            got = str(err)
        assert got == want, values


def test_a_planner_on_cpu_0_takes_host_batches_as_one_on_cpu_does():
    """The door checks a host device as ``is_cpu``: ``cpu:0`` and ``cpu`` accept the same."""
    batch = SETUP.batch(random.Random(0), bs=3, positions=True)
    for device in ("cpu", "cpu:0"):
        planner = SETUP.planner(device=device)
        assert planner.plan(batch).real_reqs == 3
        planner.capture(4, req_to_token=SETUP.table)
        assert planner.replay(batch, 4).real_reqs == 3
        meta = dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc.to("meta"))
        with pytest.raises(BatchError, match="wrong device") as err:
            planner.replay(meta, 4)
        assert err.value.field == "out_cache_loc"


@pytest.mark.parametrize("field", ["seq_lens", "page_table", "schedule"])
def test_replay_refuses_a_plan_tensor_rebound_since_capture(field):
    """``set_`` moves a captured plan tensor (an aliased one too: paged and NSA share the
    page table); the next replay names the first field that reads the moved memory."""
    planner = SETUP.planner()
    plans = planner.capture(4, req_to_token=SETUP.table)
    batch = SETUP.batch(random.Random(1), bs=2, positions=True)
    planner.replay(batch, 4)
    owner = next(b for b in plans if field in plans[b].tensors())
    tensor = plans[owner].tensors()[field]
    tensor.set_(tensor.clone())
    with pytest.raises(ReplayError, match="moved since capture") as err:
        planner.replay(batch, 4)
    first = next(f"{b}.{n}" for b in plans for n, t in plans[b].tensors().items() if t is tensor)
    assert err.value.field == first


@pytest.mark.parametrize(
    "setup, mode", [(SETUP, ForwardMode.DECODE), (VERIFY, ForwardMode.TARGET_VERIFY)]
)
def test_positions_left_out_stage_as_the_ones_they_imply(setup, mode):
    """A uniform batch without positions stages, for each request, ``L - n .. L - 1``: the
    very buffer the batch with those positions given stages."""
    planner = setup.planner()
    planner.capture(4, mode, req_to_token=setup.table)
    stager = planner._captured[(mode, 4)].storages[0].stager
    n = planner.tokens_per_request(mode)
    for seed in range(20):
        given = setup.batch(random.Random(seed), next_n=n, mode=mode, positions=True)
        staged = []
        for batch in (given, dataclasses.replace(given, positions=None)):
            planner.replay(batch, 4)
            staged.append(stager.device_buf.clone())
        assert torch.equal(staged[0], staged[1])
