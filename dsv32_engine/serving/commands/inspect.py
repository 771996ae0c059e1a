"""``python -m planner inspect DIR``: one plan dump as a table (or JSON), field by field."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dsv32_engine.serving.commands.dump_list import list_dumps, render_listing
from dsv32_engine.serving.commands.dump_text import (
    batch_text,
    dump_title,
    fail,
    head_text,
    make_console,
    shape_text,
    summary_text,
    tensor_values,
)
from dsv32_engine.serving.dumps import INDEX, LoadedDump, load_dump
from planner.errors import PlanError

Selection = list[tuple[str, str]]
"""``(backend, name)`` pairs: tensor fields, or scalars."""


def _select(dump: LoadedDump, name: str | None) -> tuple[Selection, Selection]:
    """The tensor fields and the scalars ``--field`` picks (every field, no scalar, when None)."""
    every = [(b, f) for b, f, _, _ in dump.fields()]
    if name is None:
        return every, []
    scalars = [(b, k) for b, m in dump.manifests.items() for k in m.scalars]
    picked = [(b, f) for b, f in every if name in (f, f"{b}.{f}")]
    picked_scalars = [(b, k) for b, k in scalars if name in (k, f"{b}.{k}")]
    if not picked and not picked_scalars:
        known = ", ".join(f"{b}.{f}" for b, f in every)
        known_scalars = ", ".join(f"{b}.{k}" for b, k in scalars)
        raise PlanError(
            f"no field {name!r} in {dump.path} (fields: {known}; scalars: {known_scalars})"
        )
    return picked, picked_scalars


def run(args: argparse.Namespace) -> int:
    """Render one dump, or list the dumps of a run folder; 0 on success, 2 on a
    missing/corrupt dump or unknown field."""
    root = Path(args.dump)
    if root.is_dir() and not (root / INDEX).is_file():
        found = list_dumps(root)
        if found["dumps"] or found["runs"]:
            if args.json:
                print(json.dumps(found, indent=1))
            else:
                render_listing(found, make_console(sys.stdout))
            return 0
    try:
        dump = load_dump(args.dump)
        selected, scalars = _select(dump, args.field)
    except (PlanError, OSError) as exc:
        return fail("inspect", exc)
    if args.json:
        report = _inspect_json(dump, selected, scalars, args.full)
        print(json.dumps(report, indent=1, allow_nan=False))
    else:
        console = make_console(sys.stdout)
        _inspect_render(dump, selected, args.full, args.field is not None, console)
        for backend, name in scalars:
            console.print(Text(f"{backend}.{name} = {dump.manifests[backend].scalars[name]}"))
    return 0


def _inspect_json(
    dump: LoadedDump, selected: Selection, scalars: Selection, full: bool
) -> dict[str, Any]:
    backends: dict[str, Any] = {}
    for backend, manifest in dump.manifests.items():
        names = [f for b, f in selected if b == backend]
        chosen = [k for b, k in scalars if b == backend]
        if not names and not chosen:
            continue
        data = manifest.model_dump(mode="json")
        data["fields"] = {f: data["fields"][f] for f in names}
        if chosen:
            data["scalars"] = {k: data["scalars"][k] for k in chosen}
        if full:
            for f in names:
                data["fields"][f]["values"] = tensor_values(dump.tensors[backend][f])
        backends[backend] = data
    return {
        "path": str(dump.path),
        "index": dump.index.model_dump(mode="json"),
        "backends": backends,
    }


def _inspect_render(
    dump: LoadedDump, selected: Selection, full: bool, one: bool, console: Console
) -> None:
    console.print(Text(f"Plan dump {dump_title(dump)}", style="bold"))
    first = next(iter(dump.manifests.values()), None)
    if first is not None:
        console.print(Text(f"reqs {first.reqs} ({first.real_reqs} real); {batch_text(dump)}"))
    for backend, manifest in dump.manifests.items():
        names = [f for b, f in selected if b == backend]
        if not names:
            continue
        schema = manifest.plan_schema
        table = Table(title=f"{backend}  ({schema.name} v{schema.version})", title_justify="left")
        for column in ("field", "shape", "dtype", "device", "ptr", "checksum", "summary", "head"):
            table.add_column(column, no_wrap=column in ("field", "ptr", "checksum"))
        for name in names:
            record = manifest.fields[name]
            table.add_row(
                *(
                    Text(cell)
                    for cell in (
                        name,
                        shape_text(record.shape),
                        record.dtype,
                        record.device,
                        hex(record.data_ptr),
                        record.checksum if one else record.checksum[:12],
                        summary_text(record),
                        head_text(record),
                    )
                )
            )
        console.print(table)
        if manifest.scalars and not one:
            scalars = "  ".join(f"{k}={v}" for k, v in manifest.scalars.items())
            console.print(Text(f"scalars: {scalars}"))
        if one:
            for name in names:
                console.print(
                    Text(f"{backend}.{name} spec: {json.dumps(manifest.fields[name].spec)}")
                )
        if full:
            for name in names:
                _print_full(console, f"{backend}.{name}", dump.tensors[backend][name])


def _print_full(console: Console, key: str, tensor: torch.Tensor) -> None:
    """Every value, one line per leading index, so a row can be found by eye."""
    console.print(
        Text(f"{key} {shape_text(list(tensor.shape))} {str(tensor.dtype).removeprefix('torch.')}:")
    )
    values = tensor_values(tensor)
    if tensor.dim() <= 1:
        console.print(Text(f"  {values}"))
        return
    for i, row in enumerate(values):
        console.print(Text(f"  [{i}] {row}"))
