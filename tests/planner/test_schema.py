"""Plan schemas: declarations, JSON Schema export, and errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from backends.paged import PagedPlan
from planner import (
    ForwardMode,
    Limits,
    Plan,
    Planner,
    SchemaError,
    Setting,
    Tensor,
    scalar_field,
    tensor_field,
)
from planner.errors import PlanWriteError, ProviderError
from planner.schema import parse_dim, resolve_shape

# The tests declare throwaway schemas (one naming an op that does not exist): forgotten after.
pytestmark = pytest.mark.usefixtures("isolated_registries")


def test_specs_are_collected_in_declaration_order():
    assert list(PagedPlan.tensor_specs)[:3] == ["seq_lens", "req_pool_indices", "out_cache_loc"]
    spec = PagedPlan.tensor_specs["page_table"]
    assert spec.op == "page_table" and spec.inputs == ("token_slots",) and spec.pad == 0
    assert spec.params == {"page_size": Setting("page_size")}
    assert PagedPlan.scalar_specs["max_seq_len"].value == "max_len"
    assert PagedPlan.required_dims() == {"reqs", "rows", "max_len", "pages"}


def test_json_schema_export_describes_every_field():
    schema = PagedPlan.model_json_schema()
    json.dumps(schema)
    page_table = schema["properties"]["page_table"]
    assert page_table["plan"]["dtype"] == "int32"
    assert page_table["plan"]["shape"] == ["reqs", "pages"]
    assert page_table["plan"]["params"] == {"page_size": "$page_size"}
    assert schema["properties"]["max_seq_len"]["type"] == "integer"


def test_manual_construction_validates_dtype_and_names_the_field():
    good = {name: torch.zeros(2, dtype=torch.int32) for name in PagedPlan.tensor_specs}
    good["token_slots"] = torch.zeros(2, 3, dtype=torch.int32)
    good["page_table"] = torch.zeros(2, 1, dtype=torch.int32)
    PagedPlan(**good, max_seq_len=3, next_n=1)
    with pytest.raises(SchemaError) as info:
        PagedPlan(
            **{**good, "seq_lens": torch.zeros(2, dtype=torch.int64)}, max_seq_len=3, next_n=1
        )
    assert info.value.field == "paged.seq_lens" and "int64" in str(info.value)
    with pytest.raises(SchemaError, match="rank"):
        PagedPlan(
            **{**good, "page_table": torch.zeros(2, dtype=torch.int32)}, max_seq_len=3, next_n=1
        )


def test_plans_are_frozen():
    good = {name: torch.zeros(2, dtype=torch.int32) for name in PagedPlan.tensor_specs}
    good["token_slots"] = torch.zeros(2, 3, dtype=torch.int32)
    good["page_table"] = torch.zeros(2, 1, dtype=torch.int32)
    plan = PagedPlan(**good, max_seq_len=3, next_n=1)
    with pytest.raises(PlanWriteError, match=r"^\[paged.seq_lens\] a plan is read-only"):
        plan.seq_lens = torch.ones(2, dtype=torch.int32)


def test_field_declaration_errors():
    with pytest.raises(SchemaError, match="exactly one"):
        tensor_field(torch.int32, ("reqs",), pad=0)
    with pytest.raises(SchemaError, match="pad="):
        tensor_field(torch.int32, ("reqs",), source="seq_lens")
    with pytest.raises(SchemaError, match="parse dimension"):
        tensor_field(torch.int32, ("reqs**2",), source="seq_lens", pad=1)


def test_unknown_input_is_refused_at_class_creation():
    with pytest.raises(SchemaError) as info:

        class Broken(Plan):
            seq_lens: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)
            cu: Tensor = tensor_field(
                torch.int32, ("reqs+1",), op="cumsum_with_zero", inputs=("lens",), pad=0
            )

    assert info.value.field == "cu"


def test_cycles_and_unknown_ops_and_settings_are_refused_at_planner_build():
    class Cyclic(Plan, backend="test-cyclic"):
        a: Tensor = tensor_field(
            torch.int32, ("reqs",), op="clamp", inputs=("b",), params={"lo": 0, "hi": None}, pad=0
        )
        b: Tensor = tensor_field(
            torch.int32, ("reqs",), op="clamp", inputs=("a",), params={"lo": 0, "hi": None}, pad=0
        )

    limits = Limits(max_batch=2, max_context=8)
    with pytest.raises(SchemaError, match="cycle"):
        Planner([Cyclic], limits)

    class UnknownOp(Plan, backend="test-unknown-op"):
        s: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)
        a: Tensor = tensor_field(torch.int32, ("reqs",), op="no_such_op", inputs=("s",), pad=0)

    with pytest.raises(SchemaError, match="unknown metadata op"):
        Planner([UnknownOp], limits)

    class NeedsTopk(Plan, backend="test-needs-topk"):
        s: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)
        a: Tensor = tensor_field(
            torch.int32,
            ("reqs",),
            op="clamp",
            inputs=("s",),
            params={"lo": None, "hi": Setting("topk")},
            pad=1,
        )

    with pytest.raises(SchemaError, match="topk") as info:
        Planner([NeedsTopk], limits)
    assert info.value.field == "test-needs-topk.a"
    planner = Planner([NeedsTopk], limits, options={"test-needs-topk": {"topk": 4}})
    assert planner.program(ForwardMode.DECODE).steps[0].params["hi"] == 4


def test_provider_override_errors_name_the_op(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    limits = Limits(max_batch=2, max_context=8)
    with pytest.raises(ProviderError) as info:
        Planner(["paged"], limits, providers={"page_table": "cuda_magic"})
    assert info.value.field == "page_table"
    with pytest.raises(ProviderError, match="not available"):
        Planner(["paged"], limits, providers={"page_table": "triton"})
    with pytest.raises(SchemaError, match="no planned field"):
        Planner(["paged"], limits, providers={"nonexistent_op": "torch"})


def test_dims():
    assert parse_dim("reqs+1") == ("reqs", 1)
    assert parse_dim("sms + 1") == ("sms", 1)
    assert parse_dim(4) == (None, 4)
    assert resolve_shape(("reqs+1", 2), {"reqs": 3}) == (4, 2)
    with pytest.raises(SchemaError, match="unknown dimension"):
        resolve_shape(("pages",), {"reqs": 3}, field="x")


def test_leading_dimension_only_may_depend_on_the_batch():
    class Sideways(Plan, backend="test-sideways"):
        s: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)
        t: Tensor = tensor_field(
            torch.int32, (2, "reqs"), op="clamp", inputs=("s",), params={"lo": 0, "hi": None}, pad=0
        )

    with pytest.raises(SchemaError, match="leading dimension"):
        Planner([Sideways], Limits(max_batch=2, max_context=8))


def test_scalar_field_values():
    class WithScalars(Plan, backend="test-scalars"):
        s: Tensor = tensor_field(torch.int32, ("reqs",), source="seq_lens", pad=1)
        width: int = scalar_field("max_len")
        page: int = scalar_field("page_size")

    assert set(WithScalars.scalar_specs) == {"width", "page"}
