"""A planner whose graphs pull their staged inputs (``graphs.PulledTransport``): a replay sends
nothing, the graph's pull brings the inputs, and the plans equal a fresh eager plan's, step
after step; where a host op reads the staged inputs before the graph, the replay copies them
instead; a graph run without its replay, or a launch declared twice, is named."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from graphs import PulledTransport
from planner import BatchError, ConfigError, ForwardMode, ReplayError
from tests.support.catalogue import not_pads
from tests.support.planners import PlannerSetup

BS = 4
DECODE = PlannerSetup(("nsa", "paged"), max_batch=4, max_context=256, page_size=64)
VERIFY = PlannerSetup(
    ("nsa", "paged"), max_batch=4, max_context=256, page_size=64, limits={"next_n": 2}
)
FLASHINFER = PlannerSetup(
    ("flashinfer_decode", "flashinfer_mla"),
    max_batch=4,
    max_context=256,
    page_size=64,
    options={
        "flashinfer_decode": {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64},
        "flashinfer_mla": {"num_heads": 2},
    },
)
CASES = {
    "nsa+paged decode": (DECODE, ForwardMode.DECODE),
    "nsa+paged verify": (VERIFY, ForwardMode.TARGET_VERIFY),
    "flashinfer decode (host ops)": (FLASHINFER, ForwardMode.DECODE),
}


def _captured(case: str, **kwargs):
    """A planner staging in the graph, captured at ``BS`` with the capture's own record."""
    setup, mode = CASES[case]
    planner = setup.planner(transport=PulledTransport, **kwargs)
    planner.capture(BS, mode, req_to_token=setup.table)
    planner.record(BS, mode)  # the capture's: an emulated graph runs it once, pulling nothing
    return setup, planner, mode


def _step(planner, batch):
    """One graph step: replay, the graph (its pull, then the recorded ops), the launch."""
    plans = planner.replay(batch, BS)
    planner.record(BS, plans.mode)
    planner.graph_launched()
    return plans


def _transport(planner, mode) -> PulledTransport:
    return planner._captured[(mode, BS)].stager.transport


def _count_copies(monkeypatch) -> list[bool]:
    """Every ``PulledTransport.send`` from now on, by its ``now``: a ``True`` is a copy made at
    the replay (the graph's pull then leaves the device buffer alone), a ``False`` a slot left
    for the graph to pull."""
    sends: list[bool] = []
    send = PulledTransport.send

    def counting(self, index, dev, *, now):
        sends.append(now)
        return send(self, index, dev, now=now)

    monkeypatch.setattr(PulledTransport, "send", counting)
    return sends


@pytest.mark.parametrize("case", CASES)
def test_every_step_pulls_what_a_fresh_plan_computes(case, monkeypatch):
    """Past several turns of the ring, each replay's plans equal a fresh eager plan's, and no
    replay copies: the graph's pull brings every step's inputs (FlashInfer's host ops read
    the batch and bind the fields they take by address, so they pull too), and the device
    check runs inside the graph, after the pull."""
    setup, planner, mode = _captured(case)
    assert planner._captured[(mode, BS)].checks_in_graph
    transport = _transport(planner, mode)
    sends = _count_copies(monkeypatch)
    n = planner.tokens_per_request(mode)
    rng = random.Random(7)
    for _ in range(40):
        batch = setup.batch(
            rng, bs=rng.randint(1, BS), next_n=n, mode=mode, positions=rng.random() < 0.5
        )
        plans = _step(planner, batch)
        planner.verify(batch, plans)  # bit-equal to a fresh eager plan
    assert sends == [False] * 40, "a pulled step copies nothing"
    assert transport.ring.seq == 40


def test_a_host_op_that_reads_the_staged_inputs_makes_the_replay_copy(monkeypatch):
    """A device op run outside the graph (its provider not graph-safe reads a staged field)
    needs the inputs before the graph, so the device check runs at the replay, not in the
    graph: the replay copies them and tags its slot sent."""
    setup, planner, mode = _captured("nsa+paged decode")
    captured = planner._captured[(mode, BS)]
    monkeypatch.setattr(captured, "checks_in_graph", False)
    transport = _transport(planner, mode)
    sends = _count_copies(monkeypatch)
    rng = random.Random(9)
    for step in range(3):
        batch = setup.batch(rng, bs=rng.randint(1, BS), mode=mode)
        plans = _step(planner, batch)
        planner.verify(batch, plans)
        assert sends == [True] * (step + 1), step
        assert transport.ring.meta[2 + step % 8] == 2 * step + 1, "the slot is tagged sent"


def test_a_refused_batch_is_refused_at_the_read_and_the_ring_goes_on(monkeypatch):
    """The inputs are pulled and checked inside the graph: a replay of a batch writing one KV
    slot twice sends nothing and raises nothing; the graph writes only pads into the source
    fields, the read names the field, and the next steps pull and equal eager's."""
    setup, planner, mode = _captured("nsa+paged decode")
    sends = _count_copies(monkeypatch)
    rng = random.Random(11)
    batch = setup.batch(rng, bs=3, mode=mode, positions=True)
    loc = batch.out_cache_loc.clone()
    loc[2] = loc[0]
    bad = dataclasses.replace(batch, out_cache_loc=loc)
    plans = _step(planner, bad)  # no refusal yet: nothing on the host reads the values
    assert not_pads(planner, plans) == {}
    with pytest.raises(BatchError, match="entries 0 and 2") as info:
        planner.read(torch.arange(3))
    assert info.value.field == "out_cache_loc" and info.value.actual == int(loc[0])
    for _ in range(10):
        batch = setup.batch(rng, bs=rng.randint(1, BS), mode=mode)
        plans = _step(planner, batch)
        assert planner.read(torch.arange(batch.bs)) == list(range(batch.bs))
        planner.verify(batch, plans)
    assert sends == [False] * 11 and _transport(planner, mode).ring.seq == 11


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


def test_with_the_copy_a_launch_is_nothing_to_declare():
    setup, mode = CASES["nsa+paged decode"]
    planner = setup.planner()
    planner.capture(BS, mode, req_to_token=setup.table)
    planner.graph_launched()
    planner.graph_launched()
    assert planner.staging == "copy"


def test_staging_in_the_graph_needs_the_ops_in_the_graph():
    with pytest.raises(ConfigError) as err:
        PlannerSetup(("paged",), 4, 64, 16).planner(transport=PulledTransport, ops_in_graph=False)
    assert err.value.field == "transport"
