"""Eager plans' fused launches (``planner.fusion``): the token table's two Triton steps run
as one launch, the plans bit-equal to the torch references', in every mode that has them;
a pair whose providers differ runs one by one; a fused call that fails is retired with a
notice and the plans stay right; captures never fuse."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import random  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

from backends.common import triton_kernels as tri  # noqa: E402
from planner import ForwardMode, Limits, Planner  # noqa: E402
from planner import fusion as fusion_mod  # noqa: E402
from planner.compare import diff_plans  # noqa: E402
from planner.ops import get_op  # noqa: E402
from tests.support.batches import make_pool, random_batch  # noqa: E402
from tests.support.kernels import DEVICE  # noqa: E402

pytestmark = pytest.mark.skipif(
    not tri.triton_available(DEVICE), reason=f"Triton cannot run on {DEVICE} here"
)

MAX_BATCH, MAX_CTX, PAGE = 5, 320, 64
TABLE = make_pool(2 * MAX_BATCH + 1, MAX_CTX, PAGE, seed=5).to(DEVICE)
TABLE_OPS = ("gather_token_slots", "page_table")


def _planner(backends, providers=None, next_n: int = 1) -> Planner:
    limits = Limits(
        max_batch=MAX_BATCH,
        max_context=MAX_CTX,
        num_sms=8,
        next_n=next_n,
        kv_slots=int(TABLE.max()) + 1,
        device=str(DEVICE),
    )
    return Planner(backends, limits, options={"nsa": {"topk": 16}}, providers=providers)


def _triton_table() -> dict[str, str]:
    return {op: "triton" for op in TABLE_OPS}


def _replace_fusion(monkeypatch, fn) -> fusion_mod.Fusion:
    """Registers ``fn`` in place of the token table's fusion (before a planner lays out its
    schedules); the real one is returned."""
    real = fusion_mod._FUSIONS[TABLE_OPS]
    monkeypatch.setitem(
        fusion_mod._FUSIONS,
        TABLE_OPS,
        fusion_mod.Fusion(real.first, real.second, real.provider, fn),
    )
    return real


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused calls (the wrapper replaces the registered fusion before a planner
    lays out its schedules)."""
    count = []

    def counted(outs, args, params):
        count.append(1)
        return real.fn(outs, args, params)

    real = _replace_fusion(monkeypatch, counted)
    return count


def _batches(n: int, seed: int, **kwargs):
    rng = random.Random(seed)
    table = TABLE.cpu()
    out = []
    for _ in range(n):
        batch = random_batch(rng, table, max_batch=MAX_BATCH, max_context=MAX_CTX, **kwargs)
        out.append(dataclasses.replace(batch, req_to_token=TABLE))
    return out


@pytest.mark.parametrize("backends", [["nsa"], ["paged", "nsa"]])
def test_eager_plans_fuse_the_token_table_and_equal_the_references(backends, calls):
    fused = _planner(backends, _triton_table())
    reference = _planner(backends, {op: "torch" for op in TABLE_OPS})
    for batch in _batches(12, seed=len(backends)):
        assert diff_plans(fused.plan(batch), reference.plan(batch)) == []
    assert len(calls) == 12


def test_verify_plans_fuse_too(calls):
    fused = _planner(["paged", "nsa"], _triton_table(), next_n=2)
    reference = _planner(["paged", "nsa"], {op: "torch" for op in TABLE_OPS}, next_n=2)
    mode = ForwardMode.TARGET_VERIFY
    for batch in _batches(6, seed=9, next_n=2, mode=mode):
        assert diff_plans(fused.plan(batch), reference.plan(batch)) == []
    assert len(calls) == 6


def test_a_pair_whose_providers_differ_runs_one_by_one(calls):
    mixed = _planner(["nsa"], {"gather_token_slots": "triton", "page_table": "torch"})
    reference = _planner(["nsa"], {op: "torch" for op in TABLE_OPS})
    for batch in _batches(3, seed=2):
        assert diff_plans(mixed.plan(batch), reference.plan(batch)) == []
    assert calls == []


def test_captures_run_the_steps_one_by_one(calls):
    planner = _planner(["nsa"], _triton_table())
    planner.capture(4, req_to_token=TABLE)
    assert calls == []
    (batch,) = _batches(1, seed=4)
    planner.plan(batch)
    assert calls == [1]


def test_a_failing_fused_call_is_retired_and_the_plans_stay_right(monkeypatch):
    tried = []

    def broken(outs, args, params):
        tried.append(1)
        outs[0].fill_(-3)  # half-written outputs: the steps run after it must overwrite them
        raise RuntimeError("no kernel image for this device")

    _replace_fusion(monkeypatch, broken)
    planner = _planner(["nsa"], _triton_table())
    reference = _planner(["nsa"], {op: "torch" for op in TABLE_OPS})
    batches = _batches(4, seed=7)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for batch in batches:
            assert diff_plans(planner.plan(batch), reference.plan(batch)) == []
    assert tried == [1]  # retired after the first failure
    notices = [str(w.message) for w in seen if "fused 'triton' launch failed" in str(w.message)]
    assert len(notices) == 1 and "one by one" in notices[0]
    # the steps' own providers were not retired: Triton still runs them
    steps = planner.program(ForwardMode.DECODE).steps
    assert {s.provider.name for s in steps if s.op_name in TABLE_OPS} == {"triton"}


def test_pairs_join_only_a_producer_and_its_consumer():
    planner = _planner(["nsa"], _triton_table())
    steps = planner.program(ForwardMode.DECODE).steps
    by_op = {s.op_name: s for s in steps}
    gather, pages = by_op["gather_token_slots"], by_op["page_table"]
    (joined,) = fusion_mod.fuse_steps([gather, pages])
    assert isinstance(joined, fusion_mod.FusedSteps)
    # reversed, or with a step between, nothing joins
    assert fusion_mod.fuse_steps([pages, gather]) == (pages, gather)
    clamp = by_op["clamp"]
    assert fusion_mod.fuse_steps([gather, clamp, pages]) == (gather, clamp, pages)
    # a consumer reading some other tensor is not this pair
    other = dataclasses.replace(pages, input_keys=(("nsa", "kv_lens"),))
    assert fusion_mod.fuse_steps([gather, other]) == (gather, other)


def test_registering_checks_the_ops_and_refuses_a_second_fusion():
    gather, pages = get_op("gather_token_slots"), get_op("page_table")
    with pytest.raises(ValueError, match="already have a fusion"):
        fusion_mod.fused(gather, pages, "triton")(lambda outs, args, params: None)
    with pytest.raises(ValueError, match="no provider 'deep_gemm'"):
        fusion_mod.fused(gather, pages, "deep_gemm")(lambda outs, args, params: None)
