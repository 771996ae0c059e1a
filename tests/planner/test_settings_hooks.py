"""A backend's settings API: hooks declared on ``Plan``, misspellings refused, one option list.

``defaults``, ``check_settings`` and ``derived_dims`` are overridable members of the
``Plan`` base class; a subclass name close to one of them (``check_setting``,
``default``) would be silently ignored, so the class is refused where it is defined. The
options an unknown-option error offers are exactly the options accepted: a derived
dimension, a limit or the row layout is never offered.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch

from planner import (
    ConfigError,
    Limits,
    Plan,
    Planner,
    SchemaError,
    Setting,
    Tensor,
    scalar_field,
    tensor_field,
)
from planner.settings import known_options

I32 = torch.int32


def _base_fields() -> dict[str, Any]:
    return {
        "__annotations__": {"seq_lens": Tensor, "clamped": Tensor},
        "seq_lens": tensor_field(I32, ("reqs",), source="seq_lens", pad=1),
        "clamped": tensor_field(
            I32,
            ("reqs",),
            op="clamp",
            inputs=("seq_lens",),
            params={"lo": None, "hi": Setting("cap")},
            pad=1,
        ),
    }


@pytest.mark.parametrize(
    ("name", "hook"),
    [
        ("check_setting", "check_settings"),
        ("checksettings", "check_settings"),
        ("default", "defaults"),
        ("derive_dims", "derived_dims"),
        ("derived_dim", "derived_dims"),
    ],
)
def test_a_misspelt_hook_is_refused_where_the_class_is_defined(name, hook):
    namespace = {**_base_fields(), name: classmethod(lambda cls, settings: None)}
    with pytest.raises(SchemaError, match=f"did you mean '{hook}'") as info:
        type("Misspelt", (Plan,), namespace)
    assert info.value.field == f"Misspelt.{name}"


def test_a_hook_must_be_a_classmethod_and_defaults_a_mapping():
    with pytest.raises(SchemaError, match="classmethod"):
        type("Plain", (Plan,), {**_base_fields(), "check_settings": lambda cls, s: None})
    with pytest.raises(SchemaError, match="mapping"):
        type("Listed", (Plan,), {**_base_fields(), "defaults": ["cap"]})


@functools.cache
def capped() -> type[Plan]:
    """A schema using every hook, registered when a test first needs it (not at collection)."""

    class Capped(Plan, backend="test-hooks"):
        defaults: ClassVar[dict[str, Any]] = {"cap": 8, "splits_per_sm": 2}
        seq_lens: Tensor = tensor_field(I32, ("reqs",), source="seq_lens", pad=1)
        clamped: Tensor = tensor_field(
            I32,
            ("reqs",),
            op="clamp",
            inputs=("seq_lens",),
            params={"lo": None, "hi": Setting("cap")},
            pad=1,
        )
        cap: int = scalar_field("cap")
        splits: int = scalar_field("splits", doc="a derived dimension, carried as a scalar")

        @classmethod
        def check_settings(cls, settings: Mapping[str, Any]) -> None:
            if settings["cap"] < 1:
                raise SchemaError(
                    "cap must be positive", field="test-hooks.cap", actual=settings["cap"]
                )

        @classmethod
        def derived_dims(
            cls, dims: Mapping[str, int], settings: Mapping[str, Any]
        ) -> dict[str, int]:
            return {
                "splits": max(1, dims["sms"] * settings["splits_per_sm"] // max(dims["reqs"], 1))
            }

    return Capped


def _planner(**options: Any) -> Planner:
    return Planner([capped()], Limits(max_batch=4, max_context=64), options={"test-hooks": options})


def test_the_offered_options_are_the_accepted_ones():
    assert known_options(capped()) == {"cap", "splits_per_sm"}
    _planner(cap=4, splits_per_sm=1)
    with pytest.raises(SchemaError) as info:
        _planner(splits=3)  # a derived dimension: neither offered nor accepted
    assert info.value.field == "test-hooks.splits"
    assert "splits" not in str(info.value.expected) or "splits_per_sm" in str(info.value.expected)
    assert sorted(info.value.expected) == ["cap", "splits_per_sm"]


@pytest.mark.parametrize("name", ["kernel_next_n", "row_repeat", "kernel_reqs", "max_len"])
def test_layout_and_batch_dimensions_are_never_options(name):
    with pytest.raises(ConfigError, match="derived from each batch"):
        _planner(**{name: 1})


def test_check_settings_runs_at_build_and_integer_settings_are_dimensions():
    with pytest.raises(SchemaError, match="cap must be positive"):
        _planner(cap=0)
    planner = _planner(cap=5)
    dims = planner.dims("decode", reqs=2, max_len=10)
    assert dims["cap"] == 5 and dims["splits_per_sm"] == 2 and dims["splits"] == dims["sms"]
