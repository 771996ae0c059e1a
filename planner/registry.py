"""Backends by name: in-tree ones, and third-party ones through entry points.

A separate package adds a backend without touching this repository by
declaring, in its own ``pyproject.toml``::

    [project.entry-points."forward_planner.backends"]
    mybackend = "my_package.plan"

Loading the entry point imports that module, whose ``Plan`` subclass
registers itself. Broken third-party entry points are reported once and
skipped: one bad plugin must not take the planner down.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from planner.errors import SchemaError

if TYPE_CHECKING:
    from planner.schema import Plan

ENTRY_POINT_GROUP = "forward_planner.backends"
IN_TREE = ("backends.generic_ops", "backends.paged", "backends.nsa", "backends.flashinfer")

_BACKENDS: dict[str, type[Plan]] = {}
_loaded = False
_load_errors: dict[str, str] = {}


def register_backend(plan_cls: type[Plan]) -> None:
    """Called by ``Plan.__init_subclass__``; one schema per backend name."""
    name = plan_cls.backend
    existing = _BACKENDS.get(name)
    if existing is not None and existing.__qualname__ != plan_cls.__qualname__:
        raise SchemaError(
            f"backend {name!r} already registered by {existing.__module__}.{existing.__qualname__}",
            field=name,
        )
    _BACKENDS[name] = plan_cls


def load_backends() -> None:
    """Import the in-tree backends and every installed entry point, once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in IN_TREE:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real import error inside the module
                raise
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:
            _load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            from planner.ops import warn_once

            warn_once(f"backend entry point {ep.name!r} ({ep.value}) failed to load: {exc!r}")


def get_backend(name: str) -> type[Plan]:
    """The plan schema registered as ``name``."""
    load_backends()
    if name not in _BACKENDS:
        raise SchemaError(
            "unknown backend", field="backend", expected=sorted(_BACKENDS), actual=name
        )
    return _BACKENDS[name]


def all_backends() -> dict[str, type[Plan]]:
    """Every registered backend schema by name."""
    load_backends()
    return dict(sorted(_BACKENDS.items()))


def load_errors() -> dict[str, str]:
    """Entry points that failed to load, with the reason."""
    load_backends()
    return dict(_load_errors)
