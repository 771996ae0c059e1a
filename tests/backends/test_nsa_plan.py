"""The NSA plan: the deep_gemm schedule planned once per batch, never fed zero lengths."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.deepgemm import reference_paged_mqa_schedule
from planner import ForwardMode, Limits, Planner, SchemaError
from planner.ops import get_op
from tests.support.batches import modes_for
from tests.support.planners import PlannerSetup, replay_smallest

MAX_CTX, MAX_BATCH = 700, 40
SETUP = PlannerSetup(
    ("nsa",),
    MAX_BATCH,
    MAX_CTX,
    64,
    pool=60,
    seed=3,
    limits={"num_sms": 8},
    options={"nsa": {"topk": 48}},
)
TABLE = SETUP.table


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31), next_n=st.sampled_from([1, 2]), num_sms=st.sampled_from([1, 8, 132])
)
def test_nsa_replay_equals_eager(seed, next_n, num_sms):
    rng = random.Random(seed)
    planner = SETUP.planner(next_n=next_n, num_sms=num_sms)
    modes = modes_for(next_n)
    sizes = [1, 8, 32, MAX_BATCH]
    for mode in modes:
        for bs in sizes:
            planner.capture(bs, mode, req_to_token=TABLE)
    for _ in range(6):
        batch = SETUP.batch(rng, next_n=next_n, mode=rng.choice(modes))
        bs, plans = replay_smallest(planner, batch, sizes)
        planner.verify(batch, plans)
        plan = plans["nsa"]
        n = plan.next_n
        lens = plan.kv_lens.view(-1, n)
        assert int(lens[:, -1].min()) >= 1, "padding handed a zero length to the schedule"
        expected = reference_paged_mqa_schedule(lens, 64, num_sms)
        assert torch.equal(plan.schedule, expected)
        assert torch.equal(plan.topk_lens, plan.kv_lens.clamp(max=48))
        assert plan.cu_seqlens_q.tolist() == [i * n for i in range(bs + 1)]


def test_eager_schedule_is_the_reference_of_the_batch():
    planner = SETUP.planner(next_n=1)
    batch = SETUP.batch(random.Random(1), bs=13)
    plan = planner.plan(batch)["nsa"]
    assert plan.schedule.shape == (9, 2)
    assert torch.equal(
        plan.schedule, reference_paged_mqa_schedule(batch.seq_lens_cpu.view(-1, 1), 64, 8)
    )
    assert plan.schedule[-1].tolist() == [13, 0]
    assert plan.max_seq_len == int(batch.seq_lens_cpu.max())
    assert plan.page_table.shape[1] == -(-plan.max_seq_len // 64)


def test_the_schedule_never_sees_a_zero_length(monkeypatch):
    seen = []
    provider = get_op("paged_mqa_schedule").providers["torch"]
    original = provider.fn
    planner = SETUP.planner(next_n=2)
    for step in (
        planner.program(ForwardMode.TARGET_VERIFY).steps + planner.program(ForwardMode.DECODE).steps
    ):
        if step.op_name == "paged_mqa_schedule":
            monkeypatch.setattr(
                step.chain,
                "current",
                type(provider)(
                    **{
                        **provider.__dict__,
                        "fn": lambda out, kv, *a, **k: (
                            seen.append(int(kv.view(-1, k["next_n"])[:, -1].min())),
                            original(out, kv, *a, **k),
                        ),
                    }
                ),
            )
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        for bs in (1, 8, MAX_BATCH):
            planner.capture(bs, mode, req_to_token=TABLE)
            planner.record(bs, mode)
            batch = SETUP.batch(random.Random(bs), next_n=2, mode=mode, bs=1)
            planner.replay(batch, bs)
            planner.record(bs, mode)
    assert seen and min(seen) >= 1


@pytest.mark.parametrize(
    ("limits", "options", "field"),
    [
        (dict(page_size=16), {}, "page_size"),
        (dict(), {"native_next_n": (1, 2, 3)}, "nsa.native_next_n"),
        (dict(), {"topk": 0}, "nsa.topk"),
        (dict(), {"block_kv": 128}, "nsa.block_kv"),
        (dict(), {"schedule_layout": "2027"}, "nsa.schedule_layout"),
    ],
)
def test_settings_deep_gemm_rejects_are_refused_at_build(limits, options, field):
    base = dict(max_batch=4, max_context=256, page_size=64)
    with pytest.raises(SchemaError) as info:
        Planner(["nsa"], Limits(**{**base, **limits}), options={"nsa": options})
    assert info.value.field == field


def test_one_schedule_per_batch_for_a_61_layer_stack():
    planner = SETUP.planner(next_n=1)
    rng = random.Random(9)
    for _ in range(3):
        plans = planner.plan(SETUP.batch(rng))
        for _layer in range(61):
            assert plans["nsa"].schedule.shape == (9, 2)  # every layer reads the same tensor
    assert planner.stats.op_calls["paged_mqa_schedule"] == 3


def test_fields_two_backends_share_are_computed_once():
    """NSA extends the paged plan: in one planner their common fields are one computation."""
    planner = SETUP.planner(["nsa", "paged"], max_batch=8)
    batch = SETUP.batch(random.Random(4), bs=5)
    plans = planner.plan(batch)
    assert plans["paged"].token_slots is plans["nsa"].token_slots
    assert plans["paged"].page_table is plans["nsa"].page_table
    assert planner.stats.op_calls["gather_token_slots"] == 1
    assert planner.stats.op_calls["page_table"] == 1
    planner.capture(8, req_to_token=TABLE)
    replayed = planner.replay(batch, 8)
    planner.record(8)
    assert replayed["paged"].kv_lens.data_ptr() == replayed["nsa"].kv_lens.data_ptr()
    planner.verify(batch, replayed)
