"""Staging in the graph: a replay sends nothing, the graph's pull brings the inputs, and the
plans equal a fresh eager plan's, on the lane and on every other replay path, each step
after the last; a graph run without its replay, or a launch declared twice, is named."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner import ConfigError, ForwardMode, ReplayError
from tests.support.lane_cases import BS, CASES, Sub
from tests.support.planners import PlannerSetup


def _captured(case: str, **kwargs):
    """A planner staging in the graph, captured at ``BS`` with the capture's own record."""
    setup, mode = CASES[case]
    planner = setup.planner(staging_in_graph=True, **kwargs)
    planner.capture(BS, mode, req_to_token=setup.table)
    planner.record(BS, mode)  # the capture's: an emulated graph runs it once, pulling nothing
    return setup, planner, mode


def _step(planner, batch):
    """One graph step: replay, the graph (its pull, then the recorded ops), the launch."""
    plans = planner.replay(batch, BS)
    planner.record(BS, plans.mode)
    planner.graph_launched()
    return plans


def _general(batch):
    """The same batch, in a form the lane leaves to the general path (lengths of a tensor
    subclass, which the door takes)."""
    return dataclasses.replace(batch, seq_lens_cpu=batch.seq_lens_cpu.as_subclass(Sub))


@pytest.mark.parametrize("case", CASES)
def test_every_step_pulls_what_a_fresh_plan_computes(case):
    """Lane and general replays interleaved, past several turns of the ring."""
    setup, planner, mode = _captured(case)
    lane = planner._lanes[(mode, BS)]
    stager = lane.stager
    n = planner.tokens_per_request(mode)
    rng = random.Random(7)
    for step in range(40):
        batch = setup.batch(
            rng, bs=rng.randint(1, BS), next_n=n, mode=mode, positions=rng.random() < 0.5
        )
        general = step % 5 == 4
        copies = stager.copies
        plans = _step(planner, _general(batch) if general else batch)
        sent = stager.copies - copies
        assert sent == (1 if general or lane.pull is None else 0), "a pulled step sends nothing"
        planner.verify(batch, plans)  # bit-equal to a fresh eager plan
    assert stager.pull.seq == 40


def test_every_lane_of_these_setups_pulls():
    """nsa+paged has no host op. FlashInfer's plans read only the batch (the fields they
    take are bound by address) and write their summaries into the slot: they pull too."""
    for case in CASES:
        _, planner, mode = _captured(case)
        assert planner._lanes[(mode, BS)].pull is not None, case


def test_a_graph_run_without_its_replay_is_named_then_the_next_steps_are_right():
    setup, planner, mode = _captured("nsa+paged decode")
    rng = random.Random(3)
    batch = setup.batch(rng, bs=3, mode=mode)
    _step(planner, batch)
    planner.record(BS, mode)  # the graph launched again, with no replay before it
    with pytest.raises(ReplayError, match="ran without its replay") as err:
        planner.replay(batch, BS)
    assert err.value.field == "graph_launched"
    for _ in range(12):
        batch = setup.batch(rng, bs=rng.randint(1, BS), mode=mode)
        planner.verify(batch, _step(planner, batch))


def test_a_launch_declared_twice_or_before_any_replay_is_refused():
    setup, planner, mode = _captured("nsa+paged decode")
    with pytest.raises(ReplayError, match="before any replay") as err:
        planner.graph_launched()
    assert err.value.field == "graph_launched"
    _step(planner, setup.batch(random.Random(0), bs=2, mode=mode))
    with pytest.raises(ReplayError, match="without a replay") as err:
        planner.graph_launched()
    assert err.value.field == "graph_launched"


def test_a_replay_again_before_its_launch_is_the_one_the_graph_pulls():
    setup, planner, mode = _captured("nsa+paged decode")
    rng = random.Random(5)
    first, second = (setup.batch(rng, bs=b, mode=mode) for b in (2, 4))
    planner.replay(first, BS)
    plans = _step(planner, second)
    planner.verify(second, plans)


def test_without_staging_in_graph_a_launch_is_nothing_to_declare():
    setup, mode = CASES["nsa+paged decode"]
    planner = setup.planner()
    planner.capture(BS, mode, req_to_token=setup.table)
    planner.graph_launched()
    planner.graph_launched()
    assert planner._captured[(mode, BS)].storages[0].stager.pull is None


def test_staging_in_graph_needs_the_ops_in_the_graph():
    with pytest.raises(ConfigError) as err:
        PlannerSetup(("paged",), 4, 64, 16).planner(staging_in_graph=True, ops_in_graph=False)
    assert err.value.field == "staging_in_graph"


def test_the_pulled_ring_is_in_the_static_estimate():
    setup, _ = CASES["nsa+paged decode"]
    plain = setup.planner().storages.static_estimate()
    pulled = setup.planner(staging_in_graph=True).storages.static_estimate()
    extra = {key: size for key, size in pulled.items() if key not in plain}
    assert {what for _, what in extra} == {"staging (pulled)"} and all(extra.values())
    assert (ForwardMode.DECODE, "staging (pulled)") in extra
