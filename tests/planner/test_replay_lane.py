"""The replay lane changes no behaviour: a planner with lanes and one without them accept,
refuse (same error, same field) and stage (same bytes) exactly alike, on random and hostile
batches; the lane takes every valid host decode and verify batch, and its plans equal a
fresh eager plan's. Setups with host ops (FlashInfer's plan, through its torch provider on
the CPU) run them in the lane too."""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import ForwardMode, PlanError
from planner.materialise import run_steps
from planner.replay_lane import ReplayLane
from tests.support.lane_cases import BS, CASES, DECODE, HOSTILE, hostile_batches


@functools.cache
def _pair(case: str):
    """A planner with lanes and one without, both captured at ``BS``; the mode."""
    setup, mode = CASES[case]
    fast, plain = setup.planner(), setup.planner()
    for planner in (fast, plain):
        planner.capture(BS, mode, req_to_token=setup.table)
    assert (mode, BS) in fast._lanes
    plain._lanes.clear()
    return setup, fast, plain, mode


def _outcome(planner, batch, bs):
    """What a replay did: the error's class and field, or the staged device buffer."""
    try:
        plans = planner.replay(batch, bs)
    except PlanError as err:
        return (type(err).__name__, err.field), None
    stager = planner._captured[(plans.mode, plans.reqs)].storages[0].stager
    return stager.device_buf.clone(), plans


def _same(case, batch, size) -> None:
    """Both planners do the same with ``batch`` at ``size``; the lane's plans are eager's."""
    _, fast, plain, _ = _pair(case)
    want, _ = _outcome(plain, batch, size)
    got, plans = _outcome(fast, batch, size)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), got
        assert torch.equal(got, want)
        fast.record(plans.reqs, plans.mode)  # what the graph's replay runs
        fast.verify(batch, plans)  # bit-equal to a fresh eager plan of the batch
    else:
        assert got == want


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
@pytest.mark.parametrize("case", CASES)
def test_a_planner_with_lanes_behaves_as_one_without(case, hostile):
    """Every hostile change, at every batch size, with positions given and left out."""
    setup, fast, _, mode = _pair(case)
    for batch in hostile_batches(setup, mode, fast.tokens_per_request(mode), hostile):
        _same(case, batch, BS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(sorted(CASES)),
    seed=st.integers(0, 10**6),
    bs=st.integers(1, BS),
    positions=st.booleans(),
    size=st.sampled_from([BS, True, float(BS), np.int64(BS), BS - 1, 0, -1]),
)
def test_the_size_argument_is_checked_alike(case, seed, bs, positions, size):
    """A bool, a float, a numpy int, a size too small for the batch, out of range."""
    setup, fast, _, mode = _pair(case)
    n = fast.tokens_per_request(mode)
    batch = setup.batch(random.Random(seed), bs=bs, next_n=n, mode=mode, positions=positions)
    _same(case, batch, size)


@pytest.mark.parametrize("case", CASES)
def test_the_lane_takes_every_valid_host_batch_and_sends_nothing_when_it_declines(case):
    setup, fast, _, mode = _pair(case)
    lane = fast._lanes[(mode, BS)]
    stager = lane.stager
    n = fast.tokens_per_request(mode)
    for seed in range(30):
        rng = random.Random(seed)
        bs = rng.randint(2, BS)  # two requests at least: a repeated slot is a repeat
        batch = setup.batch(rng, bs=bs, next_n=n, mode=mode, positions=rng.random() < 0.5)
        before = stager.copies
        assert lane.run(batch), "a valid host batch must take the lane"
        assert stager.copies == before + 1
        for name in ("subclass slots", "repeated slot", "wrong positions", "another table"):
            before = stager.copies
            bad = HOSTILE[name](batch, setup.table)
            if bad.positions is None and name == "wrong positions":
                continue
            assert not lane.run(bad), name
            assert stager.copies == before, f"{name}: declined, yet something was sent"


def test_lanes_are_made_for_screened_uniform_captures_only():
    setup = DECODE
    planner = setup.planner()
    planner.capture(BS, ForwardMode.DECODE, req_to_token=setup.table)
    assert isinstance(planner._lanes[(ForwardMode.DECODE, BS)], ReplayLane)
    drafts = setup.planner(draft_steps=2)
    drafts.capture(BS, ForwardMode.DRAFT_DECODE, req_to_token=setup.table)
    assert (ForwardMode.DRAFT_DECODE, BS) not in drafts._lanes  # stepped: several regions


def test_debug_mode_replays_through_the_general_path(monkeypatch):
    """Debug replays read device-resident inputs and the table: never the lane."""
    setup, fast, _, _ = _pair("nsa+paged decode")
    lane = fast._lanes[(ForwardMode.DECODE, BS)]
    calls = []
    monkeypatch.setattr(type(lane), "run", lambda self, b: calls.append(b) or False)
    monkeypatch.setattr(fast, "debug", True)
    batch = setup.batch(random.Random(3), bs=2, positions=True)
    plans = fast.replay(batch, BS)
    fast.record(BS)
    fast.verify(batch, plans)
    assert calls == []


@pytest.mark.parametrize("case", [c for c in CASES if "host op" in c])
def test_prepared_host_calls_do_what_run_steps_does(case):
    """A capture's host steps as prepared calls (``HostCall``) against ``run_steps`` over the
    same tensors: the same handles, the same outputs, batch after batch."""
    setup, fast, _, mode = _pair(case)
    captured = fast._captured[(mode, BS)]
    assert len(captured.host_calls) == len(captured.host_steps) > 0
    step = captured.steps[0]
    for seed in range(10):
        batch = setup.batch(random.Random(seed), positions=seed % 2 == 0)
        (prepared,) = captured.run_host_ops(batch)
        outs = [step.tensors[call.output].clone() for call in captured.host_calls]
        general = run_steps(captured.host_steps, step.tensors, batch, True)
        assert prepared.keys() == general.keys()
        assert all(prepared[k] is general[k] for k in general)
        for call, out in zip(captured.host_calls, outs):
            assert torch.equal(step.tensors[call.output], out)


def test_a_prepared_host_call_falls_back_as_a_step_does(monkeypatch):
    """A host op's provider that fails at replay is retired, once, and the next one runs:
    the prepared call goes through the same provider chain."""
    setup, _, _, mode = _pair("nsa_flashinfer decode (host op)")
    planner = setup.planner()
    planner.capture(BS, mode, req_to_token=setup.table)
    (call,) = planner._captured[(mode, BS)].host_calls
    chain = call.chain
    failing = dataclasses.replace(chain.current, name="flaky", fn=_raise)
    monkeypatch.setattr(chain, "current", failing)
    monkeypatch.setattr(chain.op, "providers", {**chain.op.providers, "flaky": failing})
    with pytest.warns(RuntimeWarning, match="flaky"):
        call.run(setup.batch(random.Random(0)))
    assert chain.current.name != "flaky" and "flaky" in chain.retired


def _raise(*args, **kwargs):
    raise RuntimeError("a provider that fails on its first call")


@pytest.mark.parametrize("case", [c for c in CASES if "host op" in c])
def test_host_op_summaries_ride_the_staging_copy(case):
    """A host op's small output lives in the staging buffer's appendix: the lane writes it
    into the pinned buffer before the one copy, and the plan's tensor (a view of the
    staged device buffer) then holds what a fresh eager plan holds."""
    setup, fast, _, mode = _pair(case)
    lane = fast._lanes[(mode, BS)]
    assert lane.staged, "the FlashInfer summaries should be staged"
    stager = lane.stager
    base, end = stager.device_buf.data_ptr(), stager.device_buf.data_ptr() + 4 * stager._size
    for call, _ in lane.staged:
        assert base <= call.out.data_ptr() < end  # inside the staged device buffer
    for seed in range(8):
        batch = setup.batch(random.Random(seed), positions=seed % 2 == 0)
        assert lane.run(batch)
        fast.record(BS, mode)
        fast.verify(batch, lane.plans)


def test_a_staged_host_call_that_fails_leaves_the_replay_to_the_general_path(monkeypatch):
    """Nothing is sent when a staged host call raises: the general replay runs it again
    through its chain (which falls back), and the plans are still eager's."""
    setup, _, _, mode = _pair("flashinfer decode (host ops)")
    planner = setup.planner()
    planner.capture(BS, mode, req_to_token=setup.table)
    lane = planner._lanes[(mode, BS)]
    call, _ = lane.staged[0]
    calls = []

    def failing(args, host_out=None):
        calls.append(host_out)
        raise RuntimeError("a replay call that fails")

    object.__setattr__(call, "fast", failing)
    stager, batch = lane.stager, setup.batch(random.Random(5), positions=True)
    before = stager.copies
    assert not lane.run(batch) and stager.copies == before and calls
    plans = planner.replay(batch, BS)  # the general path: the chain's provider, not `fast`
    planner.record(BS, mode)
    planner.verify(batch, plans)
