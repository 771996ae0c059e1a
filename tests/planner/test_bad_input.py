"""Bad batches are refused with a PlanError naming the field, before any kernel runs."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from planner import BatchError, ForwardBatch, ForwardMode, Limits, PlanError, Planner
from planner.program import Step
from tests.support.batches import make_pool, random_batch

MAX_CTX, PAGE = 128, 16
TABLE = make_pool(16, MAX_CTX, PAGE)


def _good(**overrides) -> ForwardBatch:
    batch = random_batch(
        random.Random(0), TABLE, max_batch=4, max_context=MAX_CTX, bs=3, positions=True
    )
    return dataclasses.replace(batch, **overrides)


CASES = {
    "negative length": (
        dict(seq_lens_cpu=torch.tensor([5, -1, 3], dtype=torch.int32)),
        "seq_lens_cpu",
    ),
    "zero length": (dict(seq_lens_cpu=torch.tensor([5, 0, 3], dtype=torch.int32)), "seq_lens_cpu"),
    "length past max context": (
        dict(seq_lens_cpu=torch.tensor([5, MAX_CTX + 1, 3], dtype=torch.int32)),
        "seq_lens_cpu",
    ),
    "lengths int64": (dict(seq_lens_cpu=torch.tensor([5, 6, 3])), "seq_lens_cpu"),
    "lengths 2-D": (
        dict(seq_lens_cpu=torch.tensor([[5, 6, 3]], dtype=torch.int32)),
        "seq_lens_cpu",
    ),
    "lengths not a tensor": (dict(seq_lens_cpu=[5, 6, 3]), "seq_lens_cpu"),
    "lengths non-contiguous": (
        dict(seq_lens_cpu=torch.tensor([5, 9, 6, 9, 3, 9], dtype=torch.int32)[::2]),
        "seq_lens_cpu",
    ),
    "empty batch": (
        dict(
            seq_lens_cpu=torch.zeros(0, dtype=torch.int32),
            req_pool_indices=torch.zeros(0, dtype=torch.int64),
            out_cache_loc=torch.zeros(0, dtype=torch.int32),
            positions=None,
        ),
        "seq_lens_cpu",
    ),
    "pool index out of range": (
        dict(req_pool_indices=torch.tensor([1, 2, 16])),
        "req_pool_indices",
    ),
    "negative pool index": (dict(req_pool_indices=torch.tensor([1, -1, 2])), "req_pool_indices"),
    "pool indices wrong length": (dict(req_pool_indices=torch.tensor([1, 2])), "req_pool_indices"),
    "pool indices float": (
        dict(req_pool_indices=torch.tensor([1.0, 2.0, 3.0])),
        "req_pool_indices",
    ),
    "token table int64": (dict(req_to_token=TABLE.long()), "req_to_token"),
    "token table one column short": (
        dict(
            req_to_token=TABLE[:, :20].contiguous(),
            seq_lens_cpu=torch.tensor([5, 21, 3], dtype=torch.int32),
        ),
        "req_to_token",
    ),
    "token table 1-D": (dict(req_to_token=TABLE[0]), "req_to_token"),
    "out_cache_loc wrong length": (
        dict(out_cache_loc=torch.tensor([1, 2], dtype=torch.int32)),
        "out_cache_loc",
    ),
    "out_cache_loc past the cache": (
        dict(out_cache_loc=torch.tensor([1, 2, 10**6], dtype=torch.int32)),
        "out_cache_loc",
    ),
    "positions past max context": (
        dict(positions=torch.tensor([1, 2, MAX_CTX], dtype=torch.int32)),
        "positions",
    ),
    "next_n mismatch in decode": (dict(next_n=2), "next_n"),
    "unknown mode": (dict(mode="prefill"), "mode"),
    "device seq_lens disagree": (
        dict(seq_lens=torch.tensor([1, 1, 1], dtype=torch.int32)),
        "seq_lens",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("phase", ["plan", "replay"])
def test_bad_batch_is_refused_naming_the_field(case, phase, monkeypatch):
    planner = Planner(
        ["paged"], Limits(max_batch=4, max_context=MAX_CTX, page_size=PAGE, kv_slots=10**5)
    )
    planner.capture(4, req_to_token=TABLE)
    launched = []
    monkeypatch.setattr(Step, "run", lambda step, *a, **k: launched.append(step.key))
    overrides, field = CASES[case]
    if case == "device seq_lens disagree" and phase == "replay":
        pytest.skip(
            "device-resident values are compared only where a sync is allowed (eager, debug)"
        )
    batch = _good(**overrides)
    with pytest.raises(PlanError) as info:
        planner.plan(batch) if phase == "plan" else planner.replay(batch, 4)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)
    assert launched == [], f"a kernel ran before the batch was refused: {launched}"


def test_batch_past_max_batch():
    planner = Planner(["paged"], Limits(max_batch=2, max_context=MAX_CTX, page_size=PAGE))
    with pytest.raises(BatchError, match="max_batch") as info:
        planner.plan(_good())
    assert info.value.field == "seq_lens_cpu"


def test_replay_of_a_size_never_captured():
    planner = Planner(["paged"], Limits(max_batch=4, max_context=MAX_CTX, page_size=PAGE))
    planner.capture(4, req_to_token=TABLE)
    with pytest.raises(PlanError, match="no capture") as info:
        planner.replay(_good(), 3)
    assert info.value.field == "bs"


def test_replay_with_a_moved_token_table_is_refused():
    planner = Planner(["paged"], Limits(max_batch=4, max_context=MAX_CTX, page_size=PAGE))
    planner.capture(4, req_to_token=TABLE)
    with pytest.raises(PlanError, match="moved or reallocated") as info:
        planner.replay(_good(req_to_token=TABLE.clone()), 4)
    assert info.value.field == "req_to_token"


def test_verify_mode_needs_the_planners_next_n():
    planner = Planner(["paged"], Limits(max_batch=4, max_context=MAX_CTX, page_size=PAGE, next_n=2))
    batch = random_batch(
        random.Random(1),
        TABLE,
        max_batch=4,
        max_context=MAX_CTX,
        next_n=3,
        mode=ForwardMode.TARGET_VERIFY,
    )
    with pytest.raises(PlanError) as info:
        planner.plan(batch)
    assert info.value.field == "next_n"
    assert "expected 2" in str(info.value)
