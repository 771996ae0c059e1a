"""The replay path: host batches on any host device, tensors rebound since capture, and
positions left out (derived on the device as the lengths imply them)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner import BatchError, ForwardMode, ReplayError
from tests.support.planners import PlannerSetup

SETUP = PlannerSetup(("nsa", "paged"), max_batch=4, max_context=256, page_size=64)
VERIFY = PlannerSetup(
    ("nsa", "paged"), max_batch=4, max_context=256, page_size=64, limits={"next_n": 2}
)


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
    """A uniform batch without positions gets, for each request, ``L - n .. L - 1`` derived
    on the device by the check the graph records: after ``record`` every captured positions
    field holds them (the pad past the real tokens), as it does for the batch with those
    positions given."""
    planner = setup.planner()
    plans = planner.capture(4, mode, req_to_token=setup.table)
    fields = [
        plans[b].tensors()[name]
        for b in plans
        for name, spec in type(plans[b]).tensor_specs.items()
        if spec.source == "positions"
    ]
    assert fields
    n = planner.tokens_per_request(mode)
    for seed in range(20):
        given = setup.batch(random.Random(seed), next_n=n, mode=mode, positions=True)
        lens = given.seq_lens_cpu.tolist()
        implied = [length - n + j for length in lens for j in range(n)]
        assert given.positions.tolist() == implied
        left_out = dataclasses.replace(given, positions=None)
        for batch in (left_out, given, left_out):
            for field in fields:
                field.fill_(-7)  # what the step before left there is not what it reads
            planner.replay(batch, 4)
            planner.record(4, mode)  # the graph: the device check, then the ops
            planner.read_errors()
            for field in fields:
                pad = [0] * (field.shape[0] - len(implied))
                assert field.tolist() == implied + pad, (seed, batch.positions is None)
