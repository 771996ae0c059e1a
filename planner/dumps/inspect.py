"""Inspecting one plan dump: its fields as a table, or as JSON, chosen by name.

What ``python -m planner inspect DIR`` prints, as library calls, so an engine that dumps
plans can read them back without the demo application: :func:`print_dump` for a terminal,
:func:`inspect_report` for a script (the ``--json`` form), :func:`render_dump` onto any
rich console. Per field: shape, dtype, device, data pointer, checksum, summary and first
values; with ``full``, every value, one line per leading index.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.dumps.read import LoadedDump, as_loaded
from planner.dumps.text import (
    batch_text,
    dump_title,
    head_text,
    make_console,
    shape_text,
    summary_text,
    tensor_values,
)
from planner.errors import PlanError

Selection = list[tuple[str, str]]
"""``(backend, name)`` pairs: tensor fields, or scalars."""


def select_fields(dump: LoadedDump, name: str | None) -> tuple[Selection, Selection]:
    """The tensor fields and the scalars ``name`` picks (``NAME`` or ``BACKEND.NAME``):
    every field and no scalar when None. An unknown name is a :class:`PlanError` that
    lists what the dump holds."""
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


def inspect_report(
    dump: LoadedDump, field: str | None = None, full: bool = False
) -> dict[str, Any]:
    """The dump as strict JSON data: its index and, per backend, the manifest of the chosen
    fields (with ``full``, each field's ``values`` too)."""
    selected, scalars = select_fields(dump, field)
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


def render_dump(
    dump: LoadedDump, console: Console, field: str | None = None, full: bool = False
) -> None:
    """The dump as tables on ``console``: a title, the batch, one table per backend. One
    chosen field shows its whole checksum and spec; a chosen scalar shows its value."""
    selected, scalars = select_fields(dump, field)  # before printing: an error prints nothing
    one = field is not None
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
            values = "  ".join(f"{k}={v}" for k, v in manifest.scalars.items())
            console.print(Text(f"scalars: {values}"))
        if one:
            for name in names:
                console.print(
                    Text(f"{backend}.{name} spec: {json.dumps(manifest.fields[name].spec)}")
                )
        if full:
            for name in names:
                _print_full(console, f"{backend}.{name}", dump.tensors[backend][name])
    for backend, name in scalars:
        console.print(Text(f"{backend}.{name} = {dump.manifests[backend].scalars[name]}"))


def print_dump(
    dump: LoadedDump | str | os.PathLike[str],
    *,
    field: str | None = None,
    full: bool = False,
    file: TextIO | None = None,
) -> None:
    """Print a dump (loaded, or a path: loaded and checked first) as ``inspect`` does."""
    render_dump(as_loaded(dump), make_console(file or sys.stdout), field, full)


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
