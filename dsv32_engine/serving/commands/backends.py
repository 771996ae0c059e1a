"""``python -m planner backends`` and ``schema``: what is registered, and what it declares."""

from __future__ import annotations

import argparse
import json

import torch
from rich.console import Console
from rich.table import Table

from planner.errors import ConfigError
from planner.ops import get_op
from planner.registry import all_backends, get_backend, load_errors


def run_backends(args: argparse.Namespace) -> int:
    """The registered backends, each op field with its providers and the one chosen here."""
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"not a torch device: {args.device!r} (cpu, cuda, cuda:1)", field="--device"
        ) from None
    rows = []
    for name, cls in all_backends().items():
        for field, spec in cls.tensor_specs.items():
            if spec.op is None:
                continue
            op = get_op(spec.op)
            available = op.available_on(device)
            chosen = op.select(device).name
            rows.append(
                (
                    name,
                    field,
                    spec.op,
                    ", ".join(sorted(op.providers)),
                    ", ".join(available),
                    chosen,
                )
            )
    if args.json:
        keys = ("backend", "field", "op", "providers", "available", "chosen")
        print(json.dumps([dict(zip(keys, r)) for r in rows], indent=2))
        return 0
    console = Console()
    table = Table(title=f"Registered backends (providers on {device})")
    for column in ("backend", "field", "op", "providers", "available here", "chosen"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for name, reason in load_errors().items():
        console.print(f"[yellow]entry point {name!r} failed to load: {reason}[/]")
    return 0


def run_schema(args: argparse.Namespace) -> int:
    """A backend's plan schema as JSON Schema."""
    cls = get_backend(args.name)
    print(json.dumps(cls.model_json_schema(), indent=2))
    return 0
