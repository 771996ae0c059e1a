"""Plans are read-only to layers: reassignment is refused, and a write names its field.

Assigning or deleting a plan's field (or a plan set's plan) is refused with the library's
one-line ``PlanWriteError`` naming ``backend.field``, not pydantic's multi-line
``ValidationError``; ``model_copy(update=...)`` still makes a changed copy. Each field of a
planned plan counts its own in-place writes (``graphs.plan_writes`` reads the counts), so a
write through one field is told apart from its neighbours in the same buffer. The
in-place writes a layer makes inside a forward are in the bad-input catalogue
(``tests/planner/test_bad_input_catalogue.py``) and ``tests/graphs/test_plan_writes.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from planner import PlanWriteError
from tests.support.catalogue import NSA_PAGED_64 as NSA

ALIASED = ("nsa", "kv_lens"), ("nsa", "seq_lens")
"""Two fields of a decode plan set that are one tensor (the program's alias)."""


@pytest.fixture(scope="module")
def planner():
    return NSA.planner()


@pytest.fixture
def plans(planner):
    return planner.plan(NSA.batch(random.Random(0), bs=3))


def _one_line(err: PlanWriteError, field: str) -> None:
    assert err.field == field and f"[{field}]" in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize("name", ["kv_lens", "max_seq_len", "not_a_field"])
def test_assigning_a_plan_attribute_is_refused_naming_it(plans, name):
    plan = plans["paged"]
    before = dict(plan.__dict__)
    with pytest.raises(PlanWriteError) as err:
        setattr(plan, name, torch.zeros(3, dtype=torch.int32))
    _one_line(err.value, f"paged.{name}")
    assert "model_copy" in str(err.value)
    assert plan.__dict__ == before


def test_deleting_a_plan_field_is_refused_naming_it(plans):
    with pytest.raises(PlanWriteError) as err:
        del plans["nsa"].seq_lens
    _one_line(err.value, "nsa.seq_lens")
    assert plans["nsa"].seq_lens is not None


def test_a_plan_set_refuses_to_take_or_drop_a_plan(plans):
    with pytest.raises(PlanWriteError) as err:
        plans["paged"] = plans["nsa"]
    _one_line(err.value, "paged")
    with pytest.raises(PlanWriteError) as err:
        del plans["nsa"]
    _one_line(err.value, "nsa")
    assert set(plans) == {"nsa", "paged"}


def test_model_copy_makes_a_changed_copy(plans):
    plan = plans["paged"]
    lens = plan.kv_lens + 1
    copy = plan.model_copy(update={"kv_lens": lens})
    assert copy.kv_lens is lens and plan.kv_lens is not lens
    assert copy.page_table is plan.page_table


def test_building_a_plan_never_takes_the_refusing_path(plans):
    """``model_construct`` (the planner's) and validation set fields without
    ``__setattr__``: the refusal costs construction nothing."""
    plan = plans["paged"]
    cls, values = type(plan), dict(plan.__dict__)
    assert cls.model_construct(**values).__dict__ == values
    assert cls(**values).__dict__ == values


def _fields(plans) -> dict[tuple[str, str], torch.Tensor]:
    return {(b, n): t for b, plan in plans.items() for n, t in plan.tensors().items()}


@pytest.mark.parametrize("phase", ["eager", "capture"])
def test_each_field_counts_its_own_writes(planner, phase):
    """Fields cut from one buffer (every int32 field of an eager plan) still count writes
    apart, so a write names the field it went through; fields that are one tensor (an alias,
    a computation two backends share) are one object and count together."""
    if phase == "eager":
        plans = planner.plan(NSA.batch(random.Random(1), bs=3))
    else:
        plans = planner.capture(4, req_to_token=NSA.table)
    fields = _fields(plans)
    assert fields[ALIASED[0]] is fields[ALIASED[1]]
    assert fields[("nsa", "token_slots")] is fields[("paged", "token_slots")]
    if phase == "eager":  # an eager plan's int32 fields are cut from one buffer
        buffers = {t.untyped_storage().data_ptr() for t in fields.values()}
        assert len(buffers) < len({id(t) for t in fields.values()})
    for key, tensor in fields.items():
        before = {k: t._version for k, t in fields.items()}
        tensor.view(-1)[:1].add_(0)  # through a view of the field, as a layer would slice it
        moved = [k for k, t in fields.items() if t._version != before[k]]
        assert moved == [k for k, t in fields.items() if t is tensor], key
