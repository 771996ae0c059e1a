"""Layers read plans: each op runs once per batch whatever the depth, and writes are caught."""

from __future__ import annotations

import random

import pytest
import torch

from backends.paged import paged_attention
from planner import PlanWriteError, ReplayError
from tests.support.planners import PlannerSetup

MAX_CTX, PAGE, HEADS, DIM = 96, 16, 2, 8
SETUP = PlannerSetup(("paged",), max_batch=6, max_context=MAX_CTX, page_size=PAGE, pool=12)


class Layer(torch.nn.Module):
    """A toy attention layer: reads the plan, writes its KV, attends."""

    def __init__(self, slots: int, seed: int, writes_plan: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.nn.Parameter(torch.randn(DIM, DIM, generator=g) / DIM**0.5)
        self.k_cache = torch.randn(slots, HEADS, DIM, generator=g)
        self.v_cache = torch.randn(slots, HEADS, DIM, generator=g)
        self.writes_plan = writes_plan

    def forward(self, x: torch.Tensor, plans) -> torch.Tensor:
        plan = plans["paged"]
        if self.writes_plan:
            plan.token_slots[0, 0] += 1  # the bug debug mode exists to catch
        q = (x @ self.proj).unsqueeze(1).expand(-1, HEADS, -1)
        return x + paged_attention(plan, q, self.k_cache, self.v_cache, DIM**-0.5).mean(1)


def _setup(layers: int, debug: bool, bad_layer: int | None = None):
    table = SETUP.table
    slots = int(table.max()) + 1
    planner = SETUP.planner(debug=debug)
    model = torch.nn.ModuleList(
        Layer(slots, i, writes_plan=(i == bad_layer)) for i in range(layers)
    )
    return table, planner, model


@pytest.mark.parametrize("layers", [1, 7, 61])
def test_each_op_runs_once_per_batch_whatever_the_depth(layers):
    table, planner, model = _setup(layers, debug=False)
    rng = random.Random(layers)
    batches = 5
    for _ in range(batches):
        batch = SETUP.batch(rng)
        plans = planner.plan(batch)
        x = torch.randn(batch.bs, DIM)
        for layer in model:
            x = layer(x, plans)
    assert planner.stats.field_calls and all(
        n == batches for n in planner.stats.field_calls.values()
    )
    assert set(planner.stats.op_calls) == {  # causal lengths are the lengths in decode
        "cumsum_with_zero",
        "gather_token_slots",
        "page_table",
    }


def test_replay_counts_once_per_batch_too():
    table, planner, model = _setup(12, debug=False)
    planner.capture(6, req_to_token=table)
    rng = random.Random(1)
    for _ in range(4):
        batch = SETUP.batch(rng)
        plans = planner.replay(batch, 6)
        planner.record(6)
        x = torch.randn(6, DIM)
        for layer in model:
            x = layer(x, plans)
    assert all(n == 4 for n in planner.stats.field_calls.values())


def test_a_layer_writing_into_a_plan_is_caught_in_debug_mode():
    table, planner, model = _setup(4, debug=True, bad_layer=2)
    batch = SETUP.batch(random.Random(2))
    plans = planner.plan(batch)
    x = torch.randn(batch.bs, DIM)
    with pytest.raises(PlanWriteError) as info, planner.guard(plans):
        for layer in model:
            x = layer(x, plans)
    assert info.value.field == "paged.token_slots"


def test_guard_is_free_outside_debug_mode():
    table, planner, model = _setup(2, debug=False, bad_layer=0)
    batch = SETUP.batch(random.Random(2))
    plans = planner.plan(batch)
    with planner.guard(plans):
        model[0](torch.randn(batch.bs, DIM), plans)  # not caught: debug off, no cost paid


def test_a_write_under_replay_is_caught_by_verify():
    table, planner, model = _setup(3, debug=True, bad_layer=1)
    planner.capture(6, req_to_token=table)
    batch = SETUP.batch(random.Random(3))
    plans = planner.replay(batch, 6)
    planner.record(6)
    x = torch.randn(6, DIM)
    for layer in model:
        x = layer(x, plans)
    with pytest.raises(ReplayError) as info:
        planner.verify(batch, plans)
    assert info.value.field == "paged.token_slots"


def test_a_stale_field_is_caught_by_verify():
    """A replay whose graph skipped refreshing: the plan still holds the previous batch."""
    table, planner, _ = _setup(1, debug=True)
    planner.capture(6, req_to_token=table)
    rng = random.Random(4)
    first = SETUP.batch(rng, bs=5)
    planner.replay(first, 6)
    planner.record(6)
    second = SETUP.batch(rng, bs=5)
    plans = planner.replay(second, 6)  # record() not run: op fields are stale
    with pytest.raises(ReplayError, match="differs from eager"):
        planner.verify(second, plans)
