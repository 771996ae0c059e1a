"""Reading plans: the only way layers get batch metadata.

Layers never compute lengths, slots or schedules; when a field they need is
absent the planner and the layers disagree about the schema, and that must
fail loudly with the field's name, not as an ``AttributeError`` deep inside
a kernel wrapper. Everything here is host-side attribute access on Python
objects, so it is free inside CUDA graph capture.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.errors import PlanError

NSA = "nsa"


def nsa_plan(plans: Mapping[str, Any]) -> Any:
    """The NSA decode plan out of the per-backend mapping the planner hands over."""
    try:
        plan = plans[NSA]
    except (KeyError, TypeError):
        keys = sorted(plans) if isinstance(plans, Mapping) else type(plans).__name__
        raise PlanError(
            "no NSA plan in the plans given to the model", field=NSA, expected=NSA, actual=keys
        ) from None
    return plan


def require(plan: Any, name: str) -> Any:
    """``plan.<name>``, or ``PlanError`` naming the field when it is missing or None."""
    value = getattr(plan, name, None)
    if value is None:
        raise PlanError(
            f"the plan has no {name!r}, which the model reads",
            field=name,
            expected="present",
            actual=type(plan).__name__,
        )
    return value
