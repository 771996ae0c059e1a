"""Backends by name, found through the ``forward_planner.backends`` entry points.

Every backend, the in-tree ones included, is a package that declares itself
in its distribution's ``pyproject.toml``::

    [project.entry-points."forward_planner.backends"]
    mybackend = "my_package.plan"

so the core names none of them. Loading an entry point imports its module,
whose ``Plan`` subclass registers itself; importing a backend package
directly registers it just the same. Broken entry points are reported once
and skipped: one bad plugin must not take the planner down.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from planner.errors import SchemaError
from planner.notices import warn_once

PlanClass = type[Any]
"""A ``planner.schema.Plan`` subclass. Named loosely on purpose: the schema module registers
its subclasses here, so this module must not import it back (no cycle in the core)."""

ENTRY_POINT_GROUP = "forward_planner.backends"

_BACKENDS: dict[str, PlanClass] = {}
_loaded = False
_load_errors: dict[str, str] = {}


RESERVED = frozenset({"batch"})
"""Names no backend may take: ``batch`` owns the batch's own tensors in the planner's tables."""


def register_backend(plan_cls: PlanClass) -> None:
    """Called by ``Plan.__init_subclass__``; one schema per backend name."""
    name = plan_cls.backend
    if name in RESERVED:
        raise SchemaError(
            "backend name is reserved", field=name, expected=f"not {sorted(RESERVED)}"
        )
    existing = _BACKENDS.get(name)
    if existing is not None and existing.__qualname__ != plan_cls.__qualname__:
        raise SchemaError(
            f"backend {name!r} already registered by {existing.__module__}.{existing.__qualname__}",
            field=name,
        )
    _BACKENDS[name] = plan_cls


def load_backends() -> None:
    """Import every installed backend entry point, once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:
            _load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            warn_once(f"backend entry point {ep.name!r} ({ep.value}) failed to load: {exc!r}")


def get_backend(name: str) -> PlanClass:
    """The plan schema registered as ``name``."""
    load_backends()
    if name not in _BACKENDS:
        raise SchemaError(
            "unknown backend", field="backend", expected=sorted(_BACKENDS), actual=name
        )
    return _BACKENDS[name]


def all_backends() -> dict[str, PlanClass]:
    """Every registered backend schema by name."""
    load_backends()
    return dict(sorted(_BACKENDS.items()))


def load_errors() -> dict[str, str]:
    """Entry points that failed to load, with the reason."""
    load_backends()
    return dict(_load_errors)
