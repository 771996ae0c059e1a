"""Which plan schemas a planner makes for each mode, and whether a consumer reads them.

A backend may register one schema per set of modes (NSA: one for uniform
decode batches, one for ragged extend batches). A planner built from backend
names takes all of each backend's schemas, from classes just those; an engine
checks once, at build, that its model's layers are typed with what comes out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.batch import ForwardMode
from planner.errors import SchemaError
from planner.registry import backend_plans
from planner.schema import Plan

SchemasByMode = dict[ForwardMode, dict[str, type[Plan]]]


def schemas_by_mode(
    backends: Sequence[str | type[Plan]],
) -> dict[ForwardMode, dict[str, type[Plan]]]:
    """Each mode's schema per backend: a name brings all its schemas, a class just itself."""
    out: dict[ForwardMode, dict[str, type[Plan]]] = {}
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
    by_mode: Mapping[ForwardMode, Mapping[str, type[Plan]]],
    needs: Mapping[str, type[Plan] | tuple[type[Plan], ...]],
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
