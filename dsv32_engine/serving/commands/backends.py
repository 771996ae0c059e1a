"""``python -m planner backends``, ``schema`` and ``ops``: what is registered, and what it declares.

A backend may register one plan schema per set of forward modes (NSA: decode, extend,
draft extend), so every listing here shows every plan, labelled with its modes; ``ops``
is the catalogue of metadata ops a plan can name, with the backends that use each.
Nothing is cut: on a terminal the output takes its full width and folds a name that does
not fit; piped, it is laid out 1000 columns wide, so every row stays on one line (the output
is read by scripts, and a name split over two lines would not be found by ``grep``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from planner.batch import ForwardMode
from planner.errors import ConfigError
from planner.ops import MetadataOp, all_ops, get_op
from planner.registry import (
    PlanClass,
    all_plan_classes,
    backend_plans,
    load_errors,
    schemas_by_mode,
)

MODE_ORDER = {mode: i for i, mode in enumerate(ForwardMode)}
"""Modes in ``ForwardMode``'s order: decode first, as an engine meets them."""

PIPED_WIDTH = 1000
"""Console width when stdout is not a terminal: wide enough that no row is folded."""


def _device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"not a torch device: {text!r} (cpu, cuda, cuda:1)", field="--device"
        ) from None


def _console(out: TextIO) -> Console:
    """The terminal's width on a terminal; piped, wide enough to print every name whole."""
    width = None if out.isatty() else PIPED_WIDTH
    return Console(file=out, width=width, highlight=False, markup=False)


def _modes(modes: Iterable[ForwardMode]) -> list[str]:
    return [m.value for m in sorted(modes, key=MODE_ORDER.__getitem__)]


def _plans(name: str) -> list[PlanClass]:
    """A backend's plans, the one serving the earliest mode (decode) first."""
    return sorted(backend_plans(name), key=lambda c: min(MODE_ORDER[m] for m in c.modes))


def _op_text(row: dict[str, Any]) -> str:
    """The op a field names, and which of its named outputs the field takes."""
    return row["op"] if row["output"] is None else f"{row['op']} -> {row['output']}"


def backend_rows(device: torch.device) -> list[dict[str, Any]]:
    """One row per op field of every plan of every backend."""
    rows = []
    for name in all_plan_classes():
        for cls in _plans(name):
            for field, spec in cls.tensor_specs.items():
                if spec.op is None:
                    continue
                op = get_op(spec.op)
                rows.append(
                    {
                        "backend": name,
                        "plan": cls.__name__,
                        "modes": _modes(cls.modes),
                        "field": field,
                        "op": spec.op,
                        "output": spec.output,
                        "providers": sorted(op.providers),
                        "available": op.available_on(device),
                        "chosen": op.select(device).name,
                    }
                )
    return rows


def _columns(table: Table, titles: Iterable[str]) -> None:
    """Columns that wrap between words and fold a word too long for the column: a narrow
    terminal breaks a name onto the next line, never replaces its end with an ellipsis."""
    for title in titles:
        table.add_column(title, overflow="fold")


def run_backends(args: argparse.Namespace) -> int:
    """The registered backends: one table per plan, labelled by mode, its op fields and their
    providers (all, those usable on ``--device``, the one chosen there)."""
    device = _device(args.device)
    rows = backend_rows(device)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    console = _console(sys.stdout)
    console.print(Text(f"Registered backends (providers on {device})", style="bold"))
    plans: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        plans.setdefault((row["backend"], row["plan"]), []).append(row)
    for (backend, plan), fields in plans.items():
        modes = ", ".join(fields[0]["modes"])
        table = Table(title=f"{backend}: {plan} (modes: {modes})", title_justify="left")
        _columns(table, ("field", "op", "providers", "available here", "chosen"))
        for r in fields:
            cells = (r["field"], _op_text(r), ", ".join(r["providers"]), ", ".join(r["available"]))
            table.add_row(*(Text(c) for c in (*cells, r["chosen"])))
        console.print(table)
    for name, reason in load_errors().items():
        console.print(Text(f"entry point {name!r} failed to load: {reason}", style="yellow"))
    return 0


def run_schema(args: argparse.Namespace) -> int:
    """The JSON Schema of every plan of a backend, keyed by the forward mode it is made for
    (as the planner picks them: :func:`planner.registry.schemas_by_mode`), or of one mode's."""
    by_mode = {
        mode: schemas[args.name]
        for mode, schemas in sorted(
            schemas_by_mode([args.name]).items(), key=lambda kv: MODE_ORDER[kv[0]]
        )
    }
    schemas = {mode.value: cls.model_json_schema() for mode, cls in by_mode.items()}
    if args.mode is None:
        print(json.dumps(schemas, indent=2))
        return 0
    if args.mode == ForwardMode.IDLE.value:
        raise ConfigError(
            "idle batches run the decode plan (every row padding)",
            field="--mode",
            expected="decode",
            actual=args.mode,
        )
    if args.mode not in schemas:
        raise ConfigError(
            f"backend {args.name!r} makes no plan for this mode",
            field="--mode",
            expected=list(schemas),
            actual=args.mode,
        )
    print(json.dumps(schemas[args.mode], indent=2))
    return 0


def _package(op: MetadataOp) -> str:
    """Where the op's torch reference lives (``backends.common``: the ops every backend shares)."""
    module = op.providers["torch"].fn.__module__ if "torch" in op.providers else ""
    loaded = sys.modules.get(module)
    return (getattr(loaded, "__package__", None) or module.rpartition(".")[0]) or module


def op_rows(device: torch.device) -> list[dict[str, Any]]:
    """One row per registered metadata op, with the backends (and modes) whose plans name it."""
    used: dict[str, dict[str, set[ForwardMode]]] = {}
    for name, plans in all_plan_classes().items():
        for cls in plans:
            for spec in cls.tensor_specs.values():
                if spec.op is not None:
                    used.setdefault(spec.op, {}).setdefault(name, set()).update(cls.modes)
    rows = []
    for name, op in sorted(all_ops().items()):
        rows.append(
            {
                "op": name,
                "package": _package(op),
                "description": " ".join(op.doc.split()),
                "providers": sorted(op.providers),
                "available": op.available_on(device),
                "used_by": {b: _modes(m) for b, m in sorted(used.get(name, {}).items())},
            }
        )
    return rows


def run_ops(args: argparse.Namespace) -> int:
    """The metadata ops a plan can name: providers, and the plans that use them."""
    device = _device(args.device)
    rows = op_rows(device)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    console = _console(sys.stdout)
    console.print(Text(f"Metadata ops (providers on {device})", style="bold"))
    for r in rows:  # one block per op: six columns would not fit a terminal's width
        used_by = "; ".join(f"{b} ({', '.join(m)})" for b, m in r["used_by"].items())
        lines = [
            r["description"],
            f"providers: {', '.join(r['providers'])}; usable here: "
            f"{', '.join(r['available']) or 'none'}",
            f"used by: {used_by or 'no registered backend'}",
        ]
        console.print(Text(f"{r['op']}  ({r['package']})", style="bold"))
        for line in lines:  # wrapped lines keep the indent
            console.print(Padding(Text(line), (0, 0, 0, 2), expand=False))
    for name, reason in load_errors().items():
        console.print(Text(f"entry point {name!r} failed to load: {reason}", style="yellow"))
    return 0
