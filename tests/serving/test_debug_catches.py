"""Debug mode catches what it exists for on the paths the serving loop runs.

The decode loop with ``--debug`` (``planner.debug``) replays its graphs through the same
``Planner.replay`` and transport as without it (the graphs pull their inputs), and then
proves each replayed plan equal to a fresh eager plan. A graph op that stops refreshing
its field (a stale buffer: the schedule bug that made deep_gemm read out of bounds) and a
layer that writes into a plan it only reads are each named, by field, in the first step
they happen; the eager steps' guard names a write too. Without the bug the same loop
verifies every replay.
"""

from __future__ import annotations

import dataclasses

import pytest

from dsv32_engine.serving.report import summarize
from planner import PlanWriteError, ReplayError
from tests.support.engines import SMALL_LOOP, tiny_engine

SMALL = {**SMALL_LOOP, "planner.debug": True}


def _engine(**overrides):
    engine = tiny_engine({**SMALL, **overrides})
    engine.runner.capture()  # the graphs (emulated here) as the loop captures them
    return engine


def test_the_debug_loop_verifies_every_replay_on_the_graph_pull():
    engine = _engine()
    assert engine.planner.staging == "graph"  # the serving default: no separate debug path
    result = engine.run(progress=False)
    summary = summarize(engine, result)
    assert summary["graph_replays"] > 0
    assert engine.planner.stats.verified == summary["graph_replays"]


def test_a_graph_op_that_stops_refreshing_its_field_is_named():
    """After capture, the schedule's provider writes nothing: every replay leaves the
    capture's schedule in place, which the first verify finds."""
    engine = _engine()
    step = next(s for s in engine.planner.program("decode").steps if s.field == "schedule")
    assert step.in_graph
    chain = step.chain
    chain.current = dataclasses.replace(chain.current, fn=lambda out, *args, **params: None)
    with pytest.raises(ReplayError, match="differs from eager") as err:
        engine.run(progress=False)
    assert err.value.field == "nsa.schedule"


def _writing_layer(engine, phase: str):
    """The model's first layer writes into the plan it reads, in plans of ``phase``."""
    model = engine.model
    forward = type(model).forward

    def writes(self, input_ids, plans, *args, **kwargs):
        if plans.phase == phase and "nsa" in plans:
            plans["nsa"].topk_lens[:1] += 1  # the bug debug mode exists to catch
        return forward(self, input_ids, plans, *args, **kwargs)

    return writes


def test_a_layer_that_writes_a_replayed_plan_is_named(monkeypatch):
    engine = _engine()
    monkeypatch.setattr(type(engine.model), "forward", _writing_layer(engine, "replay"))
    with pytest.raises(ReplayError, match="differs from eager") as err:
        engine.run(progress=False)
    assert err.value.field == "nsa.topk_lens"


def test_a_layer_that_writes_an_eager_plan_is_named(monkeypatch):
    engine = _engine()  # prompt chunks run eagerly
    monkeypatch.setattr(type(engine.model), "forward", _writing_layer(engine, "eager"))
    with pytest.raises(PlanWriteError) as err:
        engine.run(progress=False)
    assert err.value.field.endswith(".topk_lens")
