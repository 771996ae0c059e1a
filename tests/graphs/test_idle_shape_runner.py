"""The graph runner routes an idle batch by its declared shape (emulated graphs, on the CPU).

A data-parallel rank with no work replays the graph its peers run (``at_least=`` their
size): for an idle-as-verify batch the verify graph, whose forward then sees ``next_n``
padding rows per request and the verify capture's plans refreshed as pure padding; for an
idle-as-draft-decode batch the draft-decode graph, stepped. A runner that did not capture
the shape falls back eagerly, counted and warned, padded with the shape's rows.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from graphs import BATCH_TOO_LARGE, MODE_NOT_CAPTURED, GraphRunner, GraphWarning
from planner import BatchError, ForwardBatch, ForwardMode, PlanSet
from tests.support.batches import idle_batch, make_pool
from tests.support.graph_model import Scheduler, TinyPagedModel, plan_digest
from tests.support.planners import PlannerSetup
from tests.support.spec_batches import draft_decode_batch

PAGE, MAX_CTX, MAX_BATCH, NEXT_N, STEPS = 4, 32, 12, 3, 2
SIZES = [1, 2, 4, 8]
POOL = 20
SLOTS = POOL * (MAX_CTX // PAGE) * PAGE
IDLE, DECODE = ForwardMode.IDLE, ForwardMode.DECODE
VERIFY, DRAFT_DECODE = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE
SETUP = PlannerSetup(
    ("paged",),
    MAX_BATCH,
    MAX_CTX,
    PAGE,
    pool=POOL,
    limits={"next_n": NEXT_N, "draft_steps": STEPS},
)
TABLE = make_pool(POOL, MAX_CTX, PAGE, seed=0)
NO_IDS = {"input_ids": torch.zeros(0, dtype=torch.int64)}


def idle(shape: ForwardMode, next_n: int) -> ForwardBatch:
    return idle_batch(TABLE, shape, next_n)


class Recording:
    """The model, remembering what each call (capture, replay, eager) saw: its plan set and
    its per-row digest of the plans, cloned (a graph's outputs are overwritten)."""

    def __init__(self) -> None:
        self.model = TinyPagedModel(SLOTS)
        self.calls: list[tuple[PlanSet, int, torch.Tensor]] = []

    def __call__(self, inputs: dict[str, torch.Tensor], plans: PlanSet) -> dict:
        rows = inputs["input_ids"].shape[0]
        if plans.steps:  # draft decode: one row per request per step, request-major
            parts = [plan_digest(plans.step(s), plans.reqs) for s in range(len(plans.steps))]
            meta = torch.stack(parts, 1).reshape(rows, -1)
            out = {"meta": meta, "hidden": torch.zeros(rows, 4, dtype=torch.float64)}
        else:
            out = self.model(inputs, plans)
        self.calls.append((plans, rows, out["meta"].clone()))
        return out


def _runner(modes, *, debug: bool = True) -> tuple[GraphRunner, Recording]:
    forward = Recording()
    runner = GraphRunner(
        SETUP.planner(debug=debug),
        forward,
        req_to_token=TABLE,
        static_inputs={"input_ids": torch.int64},
        modes=modes,
        sizes=SIZES,
    )
    return runner, forward


def test_an_idle_as_verify_batch_replays_the_verify_graph_at_the_peers_size():
    runner, forward = _runner([DECODE, VERIFY])
    sched = Scheduler(TABLE, next_n=NEXT_N, seed=1)
    batch, inputs = sched.batch(2, VERIFY)  # real rows in the verify graphs first
    runner.step(batch, inputs, at_least=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        out = runner.step(idle(VERIFY, NEXT_N), NO_IDS, at_least=4)
    assert out["meta"].shape[0] == 0 and out["hidden"].shape[0] == 0
    assert runner.stats.replays == {("target_verify", 4): 2}  # the verify graph, not decode's
    assert runner.stats.eager == {}
    plans, rows, meta = forward.calls[-1]
    assert plans is runner.last_plans and rows == 4 * NEXT_N  # next_n padding rows each
    assert plans.mode is IDLE and plans.real_reqs == 0 and plans.reqs == 4
    assert plans["paged"].kv_lens.shape[0] == 4 * NEXT_N
    # what the graph's forward read is the padded eager plan of the idle batch, bit for bit
    want = plan_digest(SETUP.planner().plan(idle(VERIFY, NEXT_N), pad_to=4), 4 * NEXT_N)
    assert torch.equal(meta, want)
    assert runner.planner.stats.verified == 2  # debug mode checked both replays
    runner.step(idle(DECODE, 1), NO_IDS, at_least=4)  # decode-shaped idle: decode's graph
    assert runner.stats.replays[("decode", 4)] == 1


def test_an_idle_as_draft_decode_batch_replays_the_stepped_draft_decode_graph():
    runner, forward = _runner([DECODE, DRAFT_DECODE])
    real = draft_decode_batch(random.Random(2), TABLE, bs=1, max_context=MAX_CTX, steps=STEPS)
    runner.step(real, {"input_ids": torch.zeros(STEPS, dtype=torch.int64)}, at_least=2)
    out = runner.step(idle(DRAFT_DECODE, STEPS), NO_IDS, at_least=2)
    assert out["meta"].shape[0] == 0
    assert runner.stats.replays == {("draft_decode", 2): 2}
    plans, rows, meta = forward.calls[-1]
    assert rows == 2 * STEPS and len(plans.steps) == STEPS
    assert plans.mode is IDLE and all(plans.step(s).mode is IDLE for s in range(STEPS))
    eager = SETUP.planner().plan(idle(DRAFT_DECODE, STEPS), pad_to=2)
    want = torch.stack([plan_digest(eager.step(s), 2) for s in range(STEPS)], 1)
    assert torch.equal(meta, want.reshape(2 * STEPS, -1))


def test_a_runner_without_the_shapes_graph_falls_back_eagerly_with_the_shapes_rows():
    runner, forward = _runner([DECODE], debug=False)
    with pytest.warns(GraphWarning, match="target_verify"):
        out = runner.step(idle(VERIFY, NEXT_N), NO_IDS, at_least=4)
    assert out["meta"].shape[0] == 0
    assert runner.stats.eager[MODE_NOT_CAPTURED] == 1 and not runner.stats.replays
    plans, rows, _ = forward.calls[-1]
    assert plans.phase == "eager" and plans.mode is IDLE and plans.reqs == 1
    assert rows == NEXT_N and plans["paged"].kv_lens.shape[0] == NEXT_N  # one verify-shaped pad


def test_an_idle_batch_past_the_largest_graph_runs_eagerly():
    runner, _ = _runner([DECODE, VERIFY], debug=False)
    with pytest.warns(GraphWarning):
        out = runner.step(idle(VERIFY, NEXT_N), NO_IDS, at_least=MAX_BATCH)
    assert out["meta"].shape[0] == 0 and runner.stats.eager[BATCH_TOO_LARGE] == 1


@pytest.mark.parametrize(("mode", "shape"), [(IDLE, "prefill"), (IDLE, ForwardMode.EXTEND)])
def test_a_wrong_idle_shape_is_refused_by_the_planner_naming_idle_as(mode, shape):
    runner, _ = _runner([DECODE, VERIFY], debug=False)
    bad = ForwardBatch(
        seq_lens_cpu=torch.zeros(0, dtype=torch.int32),
        req_pool_indices=torch.zeros(0, dtype=torch.int32),
        req_to_token=TABLE,
        out_cache_loc=torch.zeros(0, dtype=torch.int32),
        mode=mode,
        idle_as=shape,
    )
    with pytest.raises(BatchError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)  # an extend shape: eager, then refused
        runner.step(bad, NO_IDS, at_least=2)
    assert info.value.field == "idle_as"
