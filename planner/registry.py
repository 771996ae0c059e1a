"""Backends by name, found through the ``forward_planner.backends`` entry points.

Every backend, the in-tree ones included, is a package that declares itself
in its distribution's ``pyproject.toml``::

    [project.entry-points."forward_planner.backends"]
    mybackend = "my_package.plan"

so the core names none of them. Loading an entry point imports its module,
whose ``Plan`` subclass registers itself; importing a backend package
directly registers it just the same. Broken entry points are reported once
and skipped: one bad plugin must not take the planner down.

A backend may register one schema per set of modes (NSA: one for uniform decode batches,
one for ragged extend batches). A planner built from backend names takes all of each
backend's schemas, from classes just those (:func:`schemas_by_mode`); an engine checks
once, at build, that its model's layers are typed with what comes out (:func:`check_serves`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

from planner.batch import ForwardMode
from planner.errors import SchemaError, warn_once

PlanClass = type[Any]
"""A ``planner.schema.Plan`` subclass. Named loosely on purpose: the schema module registers
its subclasses here, so this module must not import it back (no cycle in the core)."""

ENTRY_POINT_GROUP = "forward_planner.backends"

_BACKENDS: dict[str, list[PlanClass]] = {}
"""Each backend's plan schemas, in registration order; their ``modes`` do not overlap."""
_loaded = False
_load_errors: dict[str, str] = {}


RESERVED = frozenset({"batch"})
"""Names no backend may take: ``batch`` owns the batch's own tensors in the planner's tables."""


def _same(a: PlanClass, b: PlanClass) -> bool:
    """The same class imported again (a reload, a second import path), not another class."""
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def register_backend(plan_cls: PlanClass) -> None:
    """Called by ``Plan.__init_subclass__``: a backend's schema for the modes it declares.

    A backend may register several schemas (e.g. one for uniform decode
    batches, one for ragged extend batches) as long as their modes do not
    overlap; a class that would take a mode another class of the backend
    already plans is refused, unless it is that class imported again (same
    module and qualified name). A class outside the installed backends' modules
    first loads them, so ``class X(Plan, backend="paged")`` in user code is
    refused whether or not ``paged`` was imported yet, never silently replacing it.
    """
    name = plan_cls.backend
    if name in RESERVED:
        raise SchemaError(
            "backend name is reserved", field=name, expected=f"not {sorted(RESERVED)}"
        )
    if not _loaded and not _from_entry_point(plan_cls):
        # A class of user code: the installed backends register first, so that one taking
        # an installed backend's name is the one refused (not the installed backend, later).
        load_backends()
    known = _BACKENDS.setdefault(name, [])
    for i, existing in enumerate(known):
        if _same(existing, plan_cls):
            known[i] = plan_cls
            return
        overlap = existing.modes & plan_cls.modes
        if overlap:
            raise SchemaError(
                f"backend {name!r} already plans {sorted(m.value for m in overlap)} with "
                f"{existing.__module__}.{existing.__qualname__}",
                field=name,
                actual=f"{plan_cls.__module__}.{plan_cls.__qualname__}",
            )
    known.append(plan_cls)


def _from_entry_point(plan_cls: PlanClass) -> bool:
    """Whether ``plan_cls`` lives in (or under) the module of an installed entry point: a
    backend registering itself, possibly halfway through its own import."""
    module = plan_cls.__module__
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        root = ep.value.partition(":")[0].strip()
        if module == root or module.startswith(root + "."):
            return True
    return False


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


def backend_plans(name: str) -> list[PlanClass]:
    """Every plan schema registered as ``name`` (one per set of modes)."""
    load_backends()
    if name not in _BACKENDS:
        raise SchemaError(
            "unknown backend", field="backend", expected=sorted(_BACKENDS), actual=name
        )
    return list(_BACKENDS[name])


def get_backend(name: str) -> PlanClass:
    """The backend's first registered schema (its uniform decode plan, for the in-tree ones)."""
    return backend_plans(name)[0]


def all_backends() -> dict[str, PlanClass]:
    """Every backend by name, with its first registered schema."""
    load_backends()
    return {name: plans[0] for name, plans in sorted(_BACKENDS.items())}


def all_plan_classes() -> dict[str, list[PlanClass]]:
    """Every backend by name, with all its schemas."""
    load_backends()
    return {name: list(plans) for name, plans in sorted(_BACKENDS.items())}


def load_errors() -> dict[str, str]:
    """Entry points that failed to load, with the reason."""
    load_backends()
    return dict(_load_errors)


SchemasByMode = dict[ForwardMode, dict[str, PlanClass]]


def schemas_by_mode(
    backends: Sequence[str | PlanClass],
) -> dict[ForwardMode, dict[str, PlanClass]]:
    """Each mode's schema per backend: a name brings all its schemas, a class just itself."""
    out: dict[ForwardMode, dict[str, PlanClass]] = {}
    for item in backends:
        classes = backend_plans(item) if isinstance(item, str) else [item]
        for cls in classes:
            for mode in cls.modes:
                if mode is ForwardMode.IDLE:
                    continue  # idle batches run decode's program, every row padding
                taken = out.setdefault(mode, {}).get(cls.backend)
                if taken is not None and taken is not cls:
                    raise SchemaError(
                        f"two schemas of backend {cls.backend!r} plan mode {mode.value}",
                        field="backends",
                        actual=[taken.__name__, cls.__name__],
                    )
                out[mode][cls.backend] = cls
    return out


def check_serves(
    by_mode: Mapping[ForwardMode, Mapping[str, PlanClass]],
    needs: Mapping[str, PlanClass | tuple[PlanClass, ...]],
    who: str,
) -> None:
    """Every schema planned for a backend ``needs`` names, in any mode, is one it accepts.

    ``needs`` maps a backend to the plan classes (or bases) the consumer's layers
    are typed with.
    """
    for backend, wanted in needs.items():
        accepted = wanted if isinstance(wanted, tuple) else (wanted,)
        planned = {
            mode: schemas[backend] for mode, schemas in by_mode.items() if backend in schemas
        }
        if not planned:
            raise SchemaError(
                f"{who} reads a plan this planner does not make",
                field=backend,
                expected=sorted({b for schemas in by_mode.values() for b in schemas}),
            )
        for mode, cls in planned.items():
            if not issubclass(cls, accepted):
                names = " or ".join(c.__name__ for c in accepted)
                raise SchemaError(
                    f"{who} reads {names}, but the planner makes {cls.__name__} "
                    f"for mode {mode.value}",
                    field=backend,
                    expected=names,
                    actual=cls.__name__,
                )
