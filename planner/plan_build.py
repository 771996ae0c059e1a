"""Frozen plans from one batch's tensors, built without pydantic's per-call work.

The planner made every tensor itself, to its spec, so validating them again per batch
would only cost host time: plans are built unvalidated. ``model_construct`` does that,
but it also walks every field's aliases and defaults on every call, about 20 us for the
nsa plan on a fast host and more on a GPU host: a tenth of an eager plan. A schema whose
fields are exactly its tensor, handle and scalar specs, with no aliases, extras, private
attributes or post-init hook (every planner schema), is built by setting what
``model_construct`` would set; any other schema goes through ``model_construct``.
Tests hold the two to the same object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.errors import SchemaError
from planner.program import Key, Program
from planner.schema import Plan

_set = object.__setattr__
_TENSOR, _HANDLE, _SCALAR = 0, 1, 2


@dataclass(frozen=True)
class Recipe:
    """Where each field of a schema comes from, in the schema's field order."""

    fields: tuple[tuple[str, int, str], ...]
    """``(name, kind, what)``: a tensor or handle of the backend, or a scalar's value name."""
    direct: bool
    """Whether the plan may be built by setting its ``__dict__`` (see the module docstring)."""


_RECIPES: dict[type[Plan], Recipe] = {}


def recipe(cls: type[Plan]) -> Recipe:
    """The schema's recipe, made once per class."""
    made = _RECIPES.get(cls)
    if made is None:
        made = _RECIPES[cls] = _make_recipe(cls)
    return made


def _make_recipe(cls: type[Plan]) -> Recipe:
    fields = []
    for name in cls.tensor_specs:
        fields.append((name, _TENSOR, name))
    for name, spec in cls.handle_specs.items():
        fields.append((name, _HANDLE, spec.of))
    for name, spec in cls.scalar_specs.items():
        fields.append((name, _SCALAR, spec.value))
    declared = getattr(cls, "__pydantic_fields__", None) or cls.model_fields
    order = {name: i for i, name in enumerate(declared)}
    plain = all(
        field.alias is None and field.validation_alias is None for field in declared.values()
    )
    direct = (
        plain
        and set(order) == {name for name, _, _ in fields}
        and cls.model_config.get("extra") != "allow"
        and getattr(cls, "__pydantic_root_model__", True) is False
        and getattr(cls, "__pydantic_post_init__", True) is None
        and not getattr(cls, "__private_attributes__", True)
    )
    if direct:
        fields.sort(key=lambda f: order[f[0]])
    return Recipe(tuple(fields), direct)


def build_plans(
    program: Program,
    tensors: Mapping[Key, Any],
    handles: Mapping[Key, Any],
    dims: Mapping[str, int],
) -> dict[str, Plan]:
    """Frozen plans over ``tensors``; scalars from the dimensions or the backend's settings
    (a backend's own value: two backends may define one setting differently)."""
    plans = {}
    for backend, cls in program.schemas.items():
        settings = program.backend_settings[backend]
        how = recipe(cls)
        values: dict[str, Any] = {}
        for name, kind, what in how.fields:
            if kind == _TENSOR:
                values[name] = tensors[(backend, what)]
            elif kind == _HANDLE:
                values[name] = handles.get((backend, what))
            elif what in dims:
                values[name] = dims[what]
            elif what in settings:
                values[name] = settings[what]
            else:
                raise SchemaError(
                    f"scalar refers to unknown value {what!r}", field=f"{backend}.{name}"
                )
        plans[backend] = _construct(cls, values) if how.direct else cls.model_construct(**values)
    return plans


def _construct(cls: type[Plan], values: dict[str, Any]) -> Plan:
    """What ``model_construct(**values)`` leaves, for a schema whose recipe is direct."""
    plan = cls.__new__(cls)
    _set(plan, "__dict__", values)
    _set(plan, "__pydantic_fields_set__", set(values))
    _set(plan, "__pydantic_extra__", None)
    _set(plan, "__pydantic_private__", None)
    return plan
