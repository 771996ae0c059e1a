"""Plans built directly equal what ``model_construct`` builds, field for field, for every
in-tree schema (a plugin's may add fields of its own: it then goes through pydantic, which
is correct, only slower); a schema the direct path cannot reproduce goes through pydantic."""

from __future__ import annotations

import random

import pytest
import torch

from planner import Limits, Planner, PlanWriteError
from planner.plans import _construct, recipe
from planner.registry import load_backends
from planner.schema import Plan
from tests.support.batches import make_pool, random_batch


def _schemas() -> list[type[Plan]]:
    load_backends()
    seen, todo = [], list(Plan.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] == "backends":
            seen.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: c.__name__)


def _values(cls: type[Plan]) -> dict:
    out = {}
    for i, (name, _, _) in enumerate(recipe(cls).fields):
        out[name] = torch.full((2,), i, dtype=torch.int32) if name in cls.tensor_specs else i
    return out


@pytest.mark.parametrize("cls", _schemas(), ids=lambda c: c.__name__)
def test_a_direct_plan_is_what_model_construct_builds(cls):
    assert recipe(cls).direct, f"{cls.__name__} would be built through model_construct"
    values = _values(cls)
    direct, reference = _construct(cls, dict(values)), cls.model_construct(**values)
    assert list(direct.__dict__) == list(reference.__dict__)  # field order: repr, dumps
    assert direct.__pydantic_fields_set__ == reference.__pydantic_fields_set__
    assert direct.__pydantic_extra__ is None and reference.__pydantic_extra__ is None
    assert direct.__pydantic_private__ == reference.__pydantic_private__
    assert all(getattr(direct, n) is getattr(reference, n) for n in values)
    with pytest.raises(PlanWriteError):  # read-only like any plan
        direct.__setattr__(next(iter(values)), 0)


def test_a_schema_with_more_than_its_specs_goes_through_model_construct():
    from pydantic import Field

    from backends.paged.plan import PagedPlan

    class Annotated(PagedPlan):
        note: str = Field(default="kept")

    assert not recipe(Annotated).direct


def test_eager_plans_are_built_directly_and_read_like_validated_ones():
    table = make_pool(9, 256, 64, seed=1)
    limits = Limits(max_batch=4, max_context=256, num_sms=8, kv_slots=int(table.max()) + 1)
    planner = Planner(["paged", "nsa"], limits, options={"nsa": {"topk": 16}})
    plans = planner.plan(random_batch(random.Random(1), table, max_batch=4, max_context=256))
    for name in ("paged", "nsa"):
        plan = plans[name]
        assert type(plan).model_validate(plan.model_dump()) is not None  # every field well-formed
        assert plan.__pydantic_fields_set__ == set(type(plan).model_fields)
