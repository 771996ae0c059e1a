"""``python -m planner``: list backends, export schemas, run decode, inspect and diff dumps."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from planner.errors import PlanError


def _cmd_backends(args: argparse.Namespace) -> int:
    from planner.ops import get_op
    from planner.registry import all_backends, load_errors

    device = torch.device(args.device)
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


def _cmd_schema(args: argparse.Namespace) -> int:
    from planner.registry import get_backend

    cls = get_backend(args.name)
    print(json.dumps(cls.model_json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m planner",
        description="forward-planner: attention metadata planned once per forward batch, CUDA-graph aware.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "backends", help="registered backends, their ops and the providers usable here"
    )
    p.add_argument("--device", default="cpu", help="device to check providers for (default: cpu)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("schema", help="JSON Schema of a backend's plan")
    p.add_argument("name", help="backend name, as listed by 'backends'")
    p.set_defaults(func=_cmd_schema)

    for module, adders in (
        ("serving.decode_cli", ("add_decode_parser",)),
        ("serving.dump_cli", ("add_inspect_parser", "add_diff_parser")),
    ):
        try:
            mod = __import__(module, fromlist=list(adders))
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        for adder in adders:
            getattr(mod, adder)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
