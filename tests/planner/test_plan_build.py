"""``build_plans`` makes each plan from its schema's specs: every tensor field its own tensor
over the planner's memory (fields that are one tensor stay one), every handle the object its
op returned, every scalar a dimension or the backend's setting; a scalar naming neither is
refused, naming the field. Every in-tree schema, and a plugin's with fields of its own."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from pydantic import Field

from planner import Limits, Planner, PlanWriteError, SchemaError
from planner.plans import build_plans
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


def _inputs(backend: str, cls: type[Plan]) -> tuple[dict, dict, dict]:
    """Tensors, handles and dimensions for every field of ``cls``: distinct values each."""
    tensors = {
        (backend, name): torch.full((2,), i, dtype=torch.int32)
        for i, name in enumerate(cls.tensor_specs)
    }
    handles = {(backend, spec.of): object() for spec in cls.handle_specs.values()}
    dims = {spec.value: 100 + i for i, spec in enumerate(cls.scalar_specs.values())}
    return tensors, handles, dims


def _program(schemas: dict[str, type[Plan]], settings: dict | None = None) -> SimpleNamespace:
    """The two things ``build_plans`` reads of a program."""
    return SimpleNamespace(
        schemas=schemas, backend_settings={b: (settings or {}).get(b, {}) for b in schemas}
    )


@pytest.mark.parametrize("cls", _schemas(), ids=lambda c: c.__name__)
def test_every_field_of_a_plan_comes_from_its_spec(cls):
    backend = cls.backend or "inputs"
    tensors, handles, dims = _inputs(backend, cls)
    plan = build_plans(_program({backend: cls}), tensors, handles, dims)[backend]
    assert type(plan) is cls
    assert list(plan.__dict__) == list(cls.model_fields)  # field order: repr, dumps
    assert plan.__pydantic_fields_set__ == set(cls.model_fields)
    for name in cls.tensor_specs:
        given, mine = tensors[(backend, name)], getattr(plan, name)
        assert mine is not given and torch.equal(mine, given)  # its own, over the same memory
        assert mine.data_ptr() == given.data_ptr() and mine.stride() == given.stride()
    for name, spec in cls.handle_specs.items():
        assert getattr(plan, name) is handles[(backend, spec.of)]
    for name, spec in cls.scalar_specs.items():
        assert getattr(plan, name) == dims[spec.value]
    with pytest.raises(PlanWriteError):  # read-only like any plan
        plan.__setattr__(next(iter(cls.model_fields)), 0)


def test_fields_that_are_one_tensor_stay_one_across_plans():
    from backends.paged.plan import PagedPlan

    tensors, handles, dims = _inputs("paged", PagedPlan)
    shared = tensors[("paged", "kv_lens")]
    tensors[("paged", "cu_seqlens_k")] = shared
    tensors.update({("other", name): t for (_, name), t in tensors.items()})
    plans = build_plans(_program({"paged": PagedPlan, "other": PagedPlan}), tensors, handles, dims)
    one = plans["paged"].kv_lens
    assert one is not shared
    assert plans["paged"].cu_seqlens_k is one
    assert plans["other"].kv_lens is one and plans["other"].cu_seqlens_k is one
    assert plans["paged"].seq_lens is not one


def test_a_scalar_is_a_dimension_else_the_backends_setting_else_refused():
    from backends.paged.plan import PagedPlan

    tensors, handles, dims = _inputs("paged", PagedPlan)
    (scalar, spec), *_ = PagedPlan.scalar_specs.items()
    del dims[spec.value]
    program = _program({"paged": PagedPlan}, {"paged": {spec.value: 7}})
    assert getattr(build_plans(program, tensors, handles, dims)["paged"], scalar) == 7
    dims[spec.value] = 5
    assert getattr(build_plans(program, tensors, handles, dims)["paged"], scalar) == 5
    del dims[spec.value]
    with pytest.raises(SchemaError, match=f"unknown value '{spec.value}'") as err:
        build_plans(_program({"paged": PagedPlan}), tensors, handles, dims)
    assert err.value.field == f"paged.{scalar}"


def test_a_field_beyond_the_specs_keeps_its_default():
    from backends.paged.plan import PagedPlan

    class Annotated(PagedPlan):
        note: str = Field(default="kept")

    tensors, handles, dims = _inputs("paged", Annotated)
    plan = build_plans(_program({"paged": Annotated}), tensors, handles, dims)["paged"]
    assert plan.note == "kept"
    assert plan.__pydantic_fields_set__ == set(PagedPlan.model_fields)


def test_eager_plans_read_like_validated_ones():
    table = make_pool(9, 256, 64, seed=1)
    limits = Limits(max_batch=4, max_context=256, num_sms=8, kv_slots=int(table.max()) + 1)
    planner = Planner(["paged", "nsa"], limits, options={"nsa": {"topk": 16}})
    plans = planner.plan(random_batch(random.Random(1), table, max_batch=4, max_context=256))
    for name in ("paged", "nsa"):
        plan = plans[name]
        assert type(plan).model_validate(plan.model_dump()) is not None  # every field well-formed
        assert plan.__pydantic_fields_set__ == set(type(plan).model_fields)
