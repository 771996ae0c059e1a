"""Idle batches of a declared shape: a data-parallel rank without work under speculative
decoding replays its peers' graph (verify, draft extend, or draft decode's k steps), never a
decode-shaped one (vLLM #35376, SGLang #15227: idle metadata built for one mode while the
forward ran another).

Each shape's idle replay must equal ``plan(idle, pad_to=bs)`` bit for bit and hold only
pads, over plans that a real batch of the shape dirtied first; the plan set stays idle with
no real request, and a draft-decode shape is stepped exactly like a real draft decode. Bad
declarations are refused at the door naming the field.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from planner import BatchError, ForwardBatch, ForwardMode, Limits, Planner, ReplayError
from planner.batch import batches_of
from planner.debug import diff_plans, padding_violations
from tests.support.batches import idle_batch, make_pool
from tests.support.spec_batches import draft_decode_batch, draft_extend_batch, verify_batch

MAX_BATCH, MAX_CTX, PAGE, SMS = 5, 320, 64, 7
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=3)
SLOTS = int(TABLE.max()) + 1
NEXT_N, STEPS = 3, 2
IDLE, DECODE = ForwardMode.IDLE, ForwardMode.DECODE
VERIFY, DRAFT_EXTEND, DRAFT_DECODE = (
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND,
    ForwardMode.DRAFT_DECODE,
)
SHAPES = {VERIFY: NEXT_N, DRAFT_EXTEND: NEXT_N, DRAFT_DECODE: STEPS}
"""Each idle shape and its tokens per request."""
SIZES = (1, 4)


def _planner(*, debug: bool = False, backends=("nsa", "paged"), steps: int = STEPS) -> Planner:
    limits = Limits(
        max_batch=MAX_BATCH,
        max_context=MAX_CTX,
        next_n=NEXT_N,
        draft_steps=steps,
        num_sms=SMS,
        kv_slots=SLOTS,
    )
    options = {b: o for b, o in {"nsa": {"topk": 16}}.items() if b in backends}
    return Planner(list(backends), limits, options=options, debug=debug)


def idle(shape: ForwardMode = DECODE, next_n: int | None = None) -> ForwardBatch:
    """A batch of no request in ``shape`` (with that shape's tokens per request by default)."""
    return idle_batch(TABLE, shape, SHAPES.get(shape, 1) if next_n is None else next_n)


def _real(shape: ForwardMode, rng: random.Random, bs: int) -> ForwardBatch:
    """A real batch of ``shape``, to dirty the captured buffers before an idle replay."""
    if shape is DRAFT_DECODE:
        return draft_decode_batch(rng, TABLE, bs=bs, max_context=MAX_CTX, steps=STEPS)
    make = verify_batch if shape is VERIFY else draft_extend_batch
    return make(rng, TABLE, bs=bs, max_context=MAX_CTX, next_n=NEXT_N)


def _assert_idle_set(plans, shape: ForwardMode, reqs: int) -> None:
    """An idle plan set of ``reqs`` requests: mode idle, no real request; stepped when the
    shape is (every step idle too), and ``next_n`` rows per request of the shape."""
    assert plans.mode is IDLE and plans.real_reqs == 0 and plans.reqs == reqs
    if shape.stepped:
        assert len(plans.steps) == STEPS
        assert set(plans) == {f"{b}@{s}" for b in ("nsa", "paged") for s in range(STEPS)}
        for s in range(STEPS):
            step = plans.step(s)
            assert step.mode is IDLE and step.real_reqs == 0
            assert step["nsa"].kv_lens.shape[0] == reqs  # a decode step: one row per request
        with pytest.raises(Exception, match="plans.step"):
            plans["nsa"]
    else:
        assert not plans.steps
        assert plans["nsa"].kv_lens.shape[0] == reqs * NEXT_N  # next_n rows per request
        assert plans["nsa"].next_n == NEXT_N


# ---- the ForwardBatch side ----------------------------------------------------------------------


def test_a_batch_plans_as_its_mode_and_an_idle_one_as_its_shape():
    assert idle().plans_as is DECODE and idle().idle_as is DECODE
    for shape in SHAPES:
        assert idle(shape).plans_as is shape
    verify = verify_batch(random.Random(0), TABLE, bs=2, max_context=MAX_CTX, next_n=NEXT_N)
    assert verify.plans_as is VERIFY
    assert (
        dataclasses.replace(idle(VERIFY), mode="idle", idle_as="target_verify").plans_as is VERIFY
    )


def test_an_idle_draft_decode_steps_into_idle_steps_of_no_request():
    steps = batches_of(idle(DRAFT_DECODE))
    assert len(steps) == STEPS
    for step in steps:
        assert step.mode is IDLE and step.plans_as is DECODE and step.next_n == 1
        assert step.bs == 0 and step.num_tokens == 0 and step.out_cache_loc.numel() == 0
    verify = idle(VERIFY)
    (only,) = batches_of(verify)
    assert only is verify  # an unstepped shape plans as the batch itself


# ---- replay equals the padded eager plan --------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES), ids=lambda m: m.value)
def test_an_idle_replay_equals_the_padded_eager_plan_of_its_shape(shape):
    planner = _planner()
    rng = random.Random(7)
    pads = planner.program(shape).pads
    for bs in SIZES:
        captured = planner.capture(bs, shape, req_to_token=TABLE)
        real = _real(shape, rng, bs)  # real rows in every buffer first: the idle must clear them
        planner.replay(real, bs)
        planner.record(bs, shape)
        replayed = planner.replay(idle(shape), bs)
        planner.record(bs, shape)
        assert replayed is captured  # the shape's own graph, not decode's
        _assert_idle_set(replayed, shape, bs)
        eager = planner.plan(idle(shape), pad_to=bs)
        _assert_idle_set(eager, shape, bs)
        assert eager.phase == "eager" and replayed.phase == "replay"
        assert not diff_plans(replayed, eager)
        real_rows = planner.real_rows(shape, idle(shape))
        assert set(real_rows.values()) == {0}
        assert not padding_violations(replayed, pads, real_rows)
        # and the real batch still replays right after the idle one
        again = planner.replay(real, bs)
        planner.record(bs, shape)
        assert again.mode is shape and not diff_plans(again, planner.plan(real, pad_to=bs))


@pytest.mark.parametrize("shape", list(SHAPES), ids=lambda m: m.value)
def test_an_idle_replay_never_touches_the_decode_graph(shape):
    """The bug upstream: idle metadata refreshed for decode while the forward ran verify. The
    decode capture must keep its plans exactly; the shape's capture is the one refreshed."""
    planner = _planner()
    rng = random.Random(3)
    decode = planner.capture(4, DECODE, req_to_token=TABLE)
    planner.capture(4, shape, req_to_token=TABLE)
    real_decode = verify_batch(rng, TABLE, bs=3, max_context=MAX_CTX, next_n=1)
    real_decode = dataclasses.replace(real_decode, mode=DECODE)
    planner.replay(real_decode, 4)
    planner.record(4, DECODE)
    before = {k: t.clone() for b in decode for k, t in decode[b].tensors().items()}
    planner.replay(_real(shape, rng, 2), 4)
    planner.record(4, shape)
    plans = planner.replay(idle(shape), 4)
    planner.record(4, shape)
    assert plans is not decode
    after = {k: t for b in decode for k, t in decode[b].tensors().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    replayed = planner.replay(real_decode, 4)
    planner.record(4, DECODE)
    assert not diff_plans(replayed, planner.plan(real_decode, pad_to=4))


@pytest.mark.parametrize("shape", list(SHAPES), ids=lambda m: m.value)
def test_an_eager_idle_plans_one_padding_request_of_its_shape(shape):
    planner = _planner()
    plans = planner.plan(idle(shape))
    _assert_idle_set(plans, shape, 1)  # never an empty batch: one padding request
    real_rows = planner.real_rows(shape, idle(shape))
    assert not padding_violations(plans, planner.program(shape).pads, real_rows)
    assert planner.stats.batches["eager_idle"] == 1


@pytest.mark.parametrize("shape", list(SHAPES), ids=lambda m: m.value)
def test_debug_mode_verifies_an_idle_replay_and_catches_a_corrupted_one(shape):
    planner = _planner(debug=True)
    planner.capture(4, shape, req_to_token=TABLE)
    planner.replay(_real(shape, random.Random(1), 3), 4)
    planner.record(4, shape)
    plans = planner.replay(idle(shape), 4)
    planner.record(4, shape)
    planner.verify(idle(shape), plans)
    assert planner.stats.verified == 1
    plan = plans.step(STEPS - 1)["nsa"] if shape.stepped else plans["nsa"]
    plan.kv_lens[0] = 99  # a padding row holding a real-looking length: stale or written
    with pytest.raises(ReplayError, match="kv_lens"):
        planner.verify(idle(shape), plans)


def test_the_same_planner_replays_every_shape_in_turn():
    """An idle rank follows its peers from verify to draft extend to draft decode each step."""
    planner = _planner()
    for shape in (DECODE, *SHAPES):
        planner.capture(4, shape, req_to_token=TABLE)
    rng = random.Random(11)
    for _ in range(3):
        for shape in (VERIFY, DRAFT_EXTEND, DRAFT_DECODE, DECODE):
            plans = planner.replay(idle(shape), 4)
            planner.record(4, shape)
            assert plans.mode is IDLE and bool(plans.steps) is shape.stepped
            assert not diff_plans(plans, planner.plan(idle(shape), pad_to=4))
            if shape is not DECODE:
                real = _real(shape, rng, 2)
                replayed = planner.replay(real, 4)
                planner.record(4, shape)  # the graph-safe ops run in the graph
                assert not diff_plans(replayed, planner.plan(real, pad_to=4))


def test_stats_count_idle_batches_by_what_their_shape_ran():
    """Idle batches count as idle; op counts follow the shape's program (draft decode: one
    schedule per step), so alternating shapes never miscount."""
    planner = _planner()
    for shape in SHAPES:
        planner.capture(4, shape, req_to_token=TABLE)
    before = planner.stats.op_calls["paged_mqa_schedule"]
    for shape in (VERIFY, DRAFT_DECODE, VERIFY, DRAFT_DECODE, DRAFT_EXTEND):
        planner.replay(idle(shape), 4)
        planner.record(4, shape)
    stats = planner.stats
    # verify 1 + draft decode 2 per batch (one per step) + draft extend 1
    assert stats.op_calls["paged_mqa_schedule"] - before == 2 * 1 + 2 * STEPS + 1
    assert sum(runs for key, runs in stats.program_runs.items() if IDLE in _modes(key)) == 5
    assert stats.batches["replay"] == 5
    assert stats.op_calls_per_batch((IDLE, DRAFT_DECODE))["paged_mqa_schedule"] == STEPS
    planner.plan(idle(VERIFY))
    assert stats.batches["eager_idle"] == 1


def _modes(key) -> tuple:
    return key if isinstance(key, tuple) else (key,)


# ---- refusals ----------------------------------------------------------------------------------


def _refused(planner: Planner, batch: ForwardBatch, field: str) -> BatchError:
    with pytest.raises(BatchError) as info:
        planner.plan(batch)
    assert info.value.field == field, info.value
    with pytest.raises(BatchError) as again:  # replay refuses it at the same door
        planner.replay(batch, 4)
    assert again.value.field == field
    return info.value


def test_idle_as_on_a_batch_that_is_not_idle_is_refused():
    planner = _planner()
    planner.capture(4, VERIFY, req_to_token=TABLE)
    verify = verify_batch(random.Random(0), TABLE, bs=2, max_context=MAX_CTX, next_n=NEXT_N)
    error = _refused(planner, dataclasses.replace(verify, idle_as=VERIFY), "idle_as")
    assert "idle" in str(error) and error.expected == DECODE.value


@pytest.mark.parametrize("shape", [ForwardMode.EXTEND, ForwardMode.MIXED, IDLE, "prefill", 3])
def test_an_idle_shape_that_is_not_a_uniform_mode_is_refused(shape):
    error = _refused(_planner(), dataclasses.replace(idle(), idle_as=shape), "idle_as")
    assert error.expected == [m.value for m in (DECODE, VERIFY, DRAFT_EXTEND, DRAFT_DECODE)]


@pytest.mark.parametrize(
    ("shape", "next_n", "want"),
    [
        (VERIFY, 1, NEXT_N),
        (DRAFT_EXTEND, STEPS, NEXT_N),
        (DRAFT_DECODE, NEXT_N, STEPS),
        (DECODE, 3, 1),
    ],
)
def test_an_idle_batch_carries_its_shapes_tokens_per_request(shape, next_n, want):
    error = _refused(_planner(), idle(shape, next_n), "next_n")
    assert error.expected == want and error.actual == next_n
    assert shape.value in str(error)


def test_a_shape_the_planner_does_not_plan_is_refused_naming_what_it_plans():
    paged = _planner(backends=("paged",))  # no draft-extend schema
    error = _refused(paged, idle(DRAFT_EXTEND), "idle_as")
    assert error.expected == [m.value for m in (DECODE, VERIFY, DRAFT_DECODE)]
    no_steps = _planner(steps=0)  # draft decode needs Limits.draft_steps
    error = _refused(no_steps, idle(DRAFT_DECODE, STEPS), "idle_as")
    assert "draft_steps" in str(error)
    assert error.expected == [m.value for m in (DECODE, VERIFY, DRAFT_EXTEND)]


def test_an_idle_replay_needs_a_capture_of_its_shape():
    planner = _planner()
    planner.capture(4, DECODE, req_to_token=TABLE)
    with pytest.raises(ReplayError, match="target_verify") as info:
        planner.replay(idle(VERIFY), 4)
    assert info.value.field == "bs" and info.value.expected == []
    planner.replay(idle(), 4)  # decode-shaped idle: the decode graph, as before


def test_a_shape_given_as_strings_plans_like_the_enum():
    """Engines may build batches from config strings: ``mode="idle", idle_as="..."``."""
    planner = _planner()
    planner.capture(4, DRAFT_DECODE, req_to_token=TABLE)
    as_str = dataclasses.replace(idle(DRAFT_DECODE), mode="idle", idle_as="draft_decode")
    plans = planner.replay(as_str, 4)
    planner.record(4, DRAFT_DECODE)
    assert plans.mode is IDLE and len(plans.steps) == STEPS
    assert not diff_plans(plans, planner.plan(idle(DRAFT_DECODE), pad_to=4))
