"""A backend's settings, and the checks of the user's options that set them.

A backend's settings come from the planner's limits, then the schema's ``defaults``,
then the user's options. An option no schema reads would be silently ignored, so it is
refused at planner build, with the names that would have been read. So is an option that
would override a limit (``{"page_size": 16}`` under ``Limits(page_size=64)`` would size the
page table by one and fill it by the other) or a dimension the planner derives per batch
(``max_len``), and an option whose type is not its default's (``"2048"`` for ``topk``).
A provider override (``providers``) must likewise name an op or a field some program runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from planner.batch import LOGIT_ROWS_MODES, VERIFY_ROWS_MODES, ForwardMode
from planner.errors import ConfigError, SchemaError
from planner.limits import Limits
from planner.schema import Plan, Setting

if TYPE_CHECKING:
    from planner.program import Program


DERIVED_DIMS = frozenset(
    {"reqs", "rows", "tokens", "kernel_reqs", "kv_tokens", "max_len", "pages", "req_pages", "sms"}
)
"""The dimensions :func:`planner.program.batch_dims` derives from each batch and the limits:
never options (``next_n`` and every integer setting are dimensions too; see
``docs/backends.md``)."""
LAYOUT = frozenset({"kernel_next_n", "row_repeat", "logit_n"})
"""The row layout's settings (:func:`planner.program.row_layout`, and ``logit_n``, the logit
rows per request), per mode: the planner's, never options."""


def settings_for(
    base: Mapping[str, Any], plan_cls: type[Plan], options: Mapping[str, Any], mode: ForwardMode
) -> dict[str, Any]:
    """Limits, then the schema's defaults, then the user's backend options; next_n per mode.

    Target verify and draft extend have ``next_n`` query rows per request;
    every other mode one row per query token. ``logit_n``: the logit rows per request of a
    ragged batch, ``next_n`` in a mixed one (its verify rows), else 1.
    """
    settings = dict(base)
    settings.update(plan_cls.defaults)
    settings.update(options)
    next_n = int(settings["next_n"])
    settings["next_n"] = next_n if mode in VERIFY_ROWS_MODES else 1
    settings["logit_n"] = next_n if mode in LOGIT_ROWS_MODES else 1
    return settings


def known_options(plan_cls: type[Plan]) -> set[str]:
    """The options a backend takes: its ``defaults`` and every ``Setting`` its fields name,
    less the limits and the dimensions the planner derives (what the unknown-option error
    offers is what is accepted). A scalar field names an option or a dimension: a derived
    dimension (``Plan.derived_dims``) is never an option."""
    names = set(plan_cls.defaults)
    for spec in plan_cls.tensor_specs.values():
        for value in (*spec.params.values(), spec.pad):
            if isinstance(value, Setting):
                names.add(value.name)
    return names - set(Limits.model_fields) - DERIVED_DIMS - LAYOUT


def check_options(
    by_mode: Mapping[Any, Mapping[str, type[Plan]]], options: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Options per planned backend, every key one of its schemas reads; a copy.

    ``by_mode`` is each mode's schema per backend: one backend's options serve
    all its schemas (the same top-k in decode and extend).
    """
    schemas: dict[str, list[type[Plan]]] = {}
    for per_backend in by_mode.values():
        for backend, cls in per_backend.items():
            if cls not in schemas.setdefault(backend, []):
                schemas[backend].append(cls)
    unknown = set(options) - set(schemas)
    if unknown:
        raise SchemaError(
            "options for backends not planned",
            field="options",
            expected=sorted(schemas),
            actual=sorted(unknown),
        )
    out = {k: dict(v) for k, v in options.items()}
    for backend, given in out.items():
        _check_not_derived(backend, given)
        known = set().union(*(known_options(cls) for cls in schemas[backend]))
        unread = sorted(set(given) - known)
        if unread:
            raise SchemaError(
                "unknown backend option",
                field=f"{backend}.{unread[0]}",
                expected=sorted(known),
                actual=unread,
            )
        for cls in schemas[backend]:
            _check_types(backend, given, cls.defaults)
    return out


def _check_not_derived(backend: str, given: Mapping[str, Any]) -> None:
    """Limits and per-batch dimensions are the planner's: an option may not set them."""
    for key, value in given.items():
        if key in Limits.model_fields:
            raise ConfigError(
                f"{key} is a planner limit, not a backend option: set it in "
                f"Limits({key}=...), which sizes the buffers and checks the batches",
                field=f"{backend}.{key}",
                actual=value,
            )
        if key in DERIVED_DIMS | LAYOUT:
            raise ConfigError(
                f"{key} is derived from each batch and the limits, not a backend option",
                field=f"{backend}.{key}",
                actual=value,
            )


def _check_types(backend: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Each option has its default's type (an int where the default is a float is fine; a
    bool is never an int); an option whose default is None takes anything."""
    for key, value in given.items():
        if key not in defaults or defaults[key] is None:
            continue
        want = type(defaults[key])
        ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ConfigError(
                "backend option of the wrong type",
                field=f"{backend}.{key}",
                expected=want.__name__,
                actual=f"{value!r} ({type(value).__name__})",
            )


def check_forced(programs: Iterable[Program], forced: Mapping[str, str]) -> None:
    """A provider override must name an op, or a ``backend.field``, that some program runs."""
    known = set()
    for program in programs:
        for step in program.steps:
            known |= {*step.keys, step.op_name}
    unknown = set(forced) - known
    if unknown:
        raise SchemaError(
            "provider override for an op no planned field uses",
            field="providers",
            expected=sorted(known),
            actual=sorted(unknown),
        )
