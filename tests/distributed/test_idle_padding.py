"""Idle and padded batches write only the null KV slot (single process, no collectives).

A data-parallel rank without requests replays an IDLE batch at its peers' graph size,
and a small batch pads to it: every padding row is the null request 0 writing KV slot
0 (page 0, never given to a request). After real requests have filled their KV, such
forwards must leave every other slot of every layer's latent and index caches as it was,
in a replay and in an eager run alike.
"""

from __future__ import annotations

import torch

from dsv32_engine.serving.requests import make_workload
from dsv32_engine.serving.run_result import RunResult
from graphs.runner import PEER_EAGER
from tests.support.engines import tiny_engine


def _snapshot(engine):
    return [t.clone() for t in engine.cache.mla + engine.cache.index]


def _changed_outside_null(before, engine):
    """Layers whose cache changed anywhere but slot 0 (latent) / page 0 (index)."""
    now = engine.cache.mla + engine.cache.index
    return [i for i, (a, b) in enumerate(zip(before, now)) if not torch.equal(a[1:], b[1:])]


def test_idle_and_padded_rows_touch_only_the_null_slot():
    engine = tiny_engine({"loop.requests": 3, "loop.arrival_rate": 100.0, "planner.max_batch": 8})
    engine.warm_up()
    result = RunResult()
    sched = engine.scheduler
    sched.arrive(make_workload(engine.config.loop, engine.model_config.vocab_size))
    sched.admit(1)
    for _ in range(3):  # prefill, then two decode steps: real KV everywhere
        engine.step(result)
    assert any(bool(t[1:].abs().sum()) for t in engine.cache.mla)
    before = _snapshot(engine)
    batch, ids = sched.idle()
    for at_least in (1, 4, 8):
        engine.runner.step(batch, {"input_ids": ids}, at_least=at_least)
        assert engine.runner.last_plans.reqs == at_least
    engine.runner.step(batch, {"input_ids": ids}, eager=PEER_EAGER)
    assert engine.runner.last_plans.phase == "eager"
    assert _changed_outside_null(before, engine) == []
    # one real request padded to 8 rows writes its own slot and the null slot only
    request = sched.running[0]
    batch, ids = sched.build([request], batch.mode.DECODE, 1)
    slot = int(batch.out_cache_loc[0])
    engine.runner.step(batch, {"input_ids": ids}, at_least=8)
    layer0 = engine.cache.mla[0]
    differs = (layer0 != before[0]).any(dim=1).nonzero().flatten().tolist()
    assert set(differs) <= {0, slot} and slot in differs
