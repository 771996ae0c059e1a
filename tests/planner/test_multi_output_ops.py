"""Ops with named outputs: one call fills several plan fields, in every phase.

FlashMLA's ``get_mla_metadata`` returns its tile schedule and its split offsets from one
computation; a schema declares one field per output (``tensor_field(..., op=, output=)``,
same inputs and params) and the planner runs the op once per batch, eagerly, at capture,
inside the graph and at replay, each field padded by its own pad. A field naming an output
the op lacks, an output no field takes, or two fields taking one output are refused at
planner build; a provider that leaves an output unwritten is caught by
:func:`planner.testing.check_provider`, as a single-output one is.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import (
    PAD_DERIVED,
    Limits,
    Plan,
    Planner,
    ProviderError,
    ReplayError,
    SchemaError,
    Setting,
    Tensor,
    metadata_op,
    scalar_field,
    tensor_field,
)
from planner.ops import get_op
from planner.testing import check_provider, random_batch, token_table

I32 = torch.int32
MAX_BATCH, MAX_CONTEXT = 6, 200
CALLS: Counter = Counter()


def _reference(splits: torch.Tensor, offsets: torch.Tensor, seq_lens, *, block: int) -> None:
    CALLS["torch"] += 1
    splits.copy_(torch.div(seq_lens + block - 1, block, rounding_mode="floor"))
    offsets[0] = 0
    torch.cumsum(splits, 0, out=offsets[1:])


def _lazy(splits: torch.Tensor, offsets: torch.Tensor, seq_lens, *, block: int) -> None:
    """A broken provider: computes the splits, forgets the offsets."""
    splits.copy_(torch.div(seq_lens + block - 1, block, rounding_mode="floor"))


CALL = {"op": "test_split_lens", "inputs": ("seq_lens",), "params": {"block": Setting("block")}}


@functools.cache
def split_plan() -> type[Plan]:
    """The op and a schema using it, registered when a test first needs them (not at
    collection: the suite's other tests then see only what they ran)."""
    split_lens = metadata_op(
        "test_split_lens",
        "splits[r] = ceil(seq_lens[r] / block); offsets = [0, cumsum(splits)]: two outputs.",
        outputs=("splits", "offsets"),
    )
    split_lens.provider("torch")(_reference)
    split_lens.provider("lazy")(_lazy)

    class SplitPlan(Plan, backend="test-multi-output"):
        defaults: ClassVar[dict[str, Any]] = {"block": 16}
        seq_lens: Tensor = tensor_field(I32, ("reqs",), source="seq_lens", pad=1)
        num_splits: Tensor = tensor_field(I32, ("reqs",), output="splits", pad=1, **CALL)
        split_offsets: Tensor = tensor_field(
            I32, ("reqs+1",), output="offsets", pad=PAD_DERIVED, **CALL
        )
        total: Tensor = tensor_field(
            I32, ("reqs+1",), op="cumsum_with_zero", inputs=("num_splits",), pad=PAD_DERIVED
        )
        block: int = scalar_field("block")

    return SplitPlan


def reference(batch, block: int) -> tuple[list[int], list[int]]:
    splits = [-(-int(n) // block) for n in batch.seq_lens_cpu]
    return splits, [0, *np.cumsum(splits).tolist()]


@functools.cache
def table() -> torch.Tensor:
    return token_table(MAX_BATCH, MAX_CONTEXT)


def planner(**kwargs) -> Planner:
    limits = Limits(max_batch=MAX_BATCH, max_context=MAX_CONTEXT, page_size=16)
    return Planner([split_plan()], limits, **kwargs)


def test_one_call_fills_both_fields_eagerly():
    p = planner(options={"test-multi-output": {"block": 32}})
    batch = random_batch(random.Random(1), table(), max_context=MAX_CONTEXT, bs=4)
    CALLS.clear()
    plan = p.plan(batch)["test-multi-output"]
    splits, offsets = reference(batch, 32)
    assert plan.num_splits.tolist() == splits and plan.split_offsets.tolist() == offsets
    assert plan.total.tolist() == [0, *np.cumsum(splits).tolist()]
    assert dict(CALLS) == {"torch": 1}
    assert p.stats.op_calls["test_split_lens"] == 1
    assert p.stats.field_calls["test-multi-output.num_splits"] == 1
    assert p.stats.field_calls["test-multi-output.split_offsets"] == 1
    assert set(p.providers_chosen()) >= {
        "test-multi-output.num_splits",
        "test-multi-output.split_offsets",
    }


@functools.cache
def captured() -> Planner:
    p = planner(debug=True)
    for bs in (2, MAX_BATCH):
        p.capture(bs, req_to_token=table())
    return p


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), bs=st.integers(1, MAX_BATCH))
def test_replay_equals_eager_and_pads_each_field(seed, bs):
    p = captured()
    size = 2 if bs <= 2 else MAX_BATCH
    batch = random_batch(random.Random(seed), table(), max_context=MAX_CONTEXT, bs=bs)
    CALLS.clear()
    plans = p.replay(batch, size)
    p.record(size)  # what the graph's replay runs: the op, once
    assert dict(CALLS) == {"torch": 1}
    p.verify(batch, plans)  # bit-equal to a fresh eager plan; each field's padding its own
    plan = plans["test-multi-output"]
    splits, offsets = reference(batch, 16)
    assert plan.num_splits.tolist() == splits + [1] * (size - bs)
    assert plan.split_offsets.tolist()[: bs + 1] == offsets


def test_a_stale_output_is_caught_by_verify():
    p = planner(debug=True)
    p.capture(MAX_BATCH, req_to_token=table())
    rng = random.Random(2)
    first = random_batch(rng, table(), max_context=MAX_CONTEXT, bs=5)
    p.replay(first, MAX_BATCH)
    p.record(MAX_BATCH)
    second = random_batch(rng, table(), max_context=MAX_CONTEXT, bs=5)
    plans = p.replay(second, MAX_BATCH)
    p.record(MAX_BATCH)
    plans["test-multi-output"].split_offsets.add_(1)  # what an output left unwritten holds
    with pytest.raises(ReplayError) as info:
        p.verify(second, plans)
    assert info.value.field == "test-multi-output.split_offsets"


def test_the_op_runs_inside_the_graph_and_its_provider_is_forced_by_any_of_its_fields():
    p = planner(providers={"test-multi-output.split_offsets": "torch"})
    (step,) = [s for s in p.program("decode").steps if s.op_name == "test_split_lens"]
    assert step.fields == ("num_splits", "split_offsets") and step.in_graph
    with pytest.raises(SchemaError, match="different providers"):
        planner(
            providers={
                "test-multi-output.split_offsets": "torch",
                "test-multi-output.num_splits": "lazy",
            }
        )


def test_the_reference_writes_every_output():
    split_plan()
    lens = torch.tensor([1, 16, 17, 300, 0], dtype=I32)
    outputs = [((5,), I32), ((6,), I32)]
    check_provider(get_op("test_split_lens"), "torch", outputs, [lens], {"block": 16})


def test_a_provider_leaving_an_output_unwritten_is_caught():
    split_plan()
    lens = torch.tensor([1, 16, 17], dtype=I32)
    outputs = [((3,), I32), ((4,), I32)]
    with pytest.raises(ProviderError) as info:
        check_provider(get_op("test_split_lens"), "lazy", outputs, [lens], {"block": 16})
    assert info.value.field == "test_split_lens.offsets"


def test_a_single_output_provider_leaving_its_output_unwritten_is_caught_the_same_way():
    op = metadata_op("test_forgetful_copy", "out = x (the second provider forgets).")
    op.provider("torch")(lambda out, x: out.copy_(x))
    op.provider("forgetful")(lambda out, x: None)
    x = torch.arange(5, dtype=I32)
    check_provider(op, "torch", [((5,), I32)], [x])
    with pytest.raises(ProviderError, match="differs"):
        check_provider(op, "forgetful", [((5,), I32)], [x])


def _schema(name: str, **fields: Any) -> type[Plan]:
    """A plan class with a staged ``seq_lens`` and ``fields``, registered as ``name``."""
    namespace = {
        "__annotations__": {"seq_lens": Tensor, **dict.fromkeys(fields, Tensor)},
        "seq_lens": tensor_field(I32, ("reqs",), source="seq_lens", pad=1),
        **fields,
    }
    return type(name, (Plan,), namespace, backend=name)


SPLITS = functools.partial(tensor_field, I32, ("reqs",), pad=1)
OFFSETS = functools.partial(tensor_field, I32, ("reqs+1",), pad=PAD_DERIVED)
CALL16 = {**CALL, "params": {"block": 16}}


@pytest.mark.parametrize(
    ("fields", "match", "field"),
    [
        (
            {"a": SPLITS(output="splits", **CALL16), "b": OFFSETS(output="offset", **CALL16)},
            "has no output 'offset'",
            "b",
        ),
        (
            {"a": SPLITS(output="splits", **CALL16), "b": OFFSETS(**CALL16)},
            "has named outputs",
            "b",
        ),
        ({"a": SPLITS(output="splits", **CALL16)}, "writes every output", "a"),
        (
            {"a": SPLITS(output="splits", **CALL16), "b": SPLITS(output="splits", **CALL16)},
            "two fields take output 'splits'",
            "b",
        ),
        (
            {"a": SPLITS(op="clamp", inputs=("seq_lens",), output="x")},
            "one unnamed output",
            "a",
        ),
    ],
    ids=["unknown output", "no output named", "output without field", "output twice", "single"],
)
def test_a_schema_misusing_named_outputs_is_refused_at_build(fields, match, field):
    split_plan()
    name = f"test-mo-{field}-{abs(hash(match)) % 10**6}"
    with pytest.raises(SchemaError, match=match) as info:
        planner_for = Planner([_schema(name, **fields)], Limits(max_batch=2, max_context=64))
        del planner_for
    assert info.value.field == f"{name}.{field}"


def test_output_needs_an_op_and_named_outputs_are_distinct():
    with pytest.raises(SchemaError, match="needs op="):
        tensor_field(I32, ("reqs",), source="seq_lens", output="splits", pad=1)
    with pytest.raises(SchemaError, match="two or more distinct"):
        metadata_op("test_one_named", "one named output", outputs=("only",))
    with pytest.raises(SchemaError, match="two or more distinct"):
        metadata_op("test_twice_named", "a name twice", outputs=("a", "a"))


def test_two_backends_declaring_the_same_call_share_it():
    split_plan()

    class Twin(Plan, backend="test-multi-output-twin"):
        seq_lens: Tensor = tensor_field(I32, ("reqs",), source="seq_lens", pad=1)
        splits: Tensor = SPLITS(output="splits", **CALL16)
        offsets: Tensor = OFFSETS(output="offsets", **CALL16)

    p = Planner([split_plan(), Twin], Limits(max_batch=MAX_BATCH, max_context=MAX_CONTEXT))
    steps = [s for s in p.program("decode").steps if s.op_name == "test_split_lens"]
    assert len(steps) == 1  # computed once, read by both
    batch = random_batch(random.Random(5), table(), max_context=MAX_CONTEXT, bs=3)
    plans = p.plan(batch)
    assert plans["test-multi-output-twin"].offsets is plans["test-multi-output"].split_offsets
