"""Diffing two plan dumps: every field of either, compared, and where they differ.

What ``python -m planner diff A B`` prints, as library calls: :func:`diff_dumps` compares
two loaded dumps with :func:`planner.debug.diff_plans` (bit-equality) and adds what a
reader needs to locate a stale buffer (shapes, dtypes, data pointers, the differing rows
and elements); :func:`print_diff` prints the tables, :func:`diff_report` is the ``--json``
form, :func:`render_diff` writes onto any rich console.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.debug import diff_plans
from planner.dumps.format import json_value
from planner.dumps.read import DumpedPlan, LoadedDump, as_loaded
from planner.dumps.text import batch_text, dump_title, fmt_value, make_console, shape_text

MAX_ROWS_LISTED = 64
"""Differing rows named in a diff; the count is always exact."""


@dataclass
class FieldDiff:
    """One field of two dumps, compared: what a reader needs to locate a stale buffer."""

    backend: str
    field: str
    kind: str  # "tensor" or "scalar"
    status: str  # "equal", "differs", "only in A", "only in B"
    reason: str = ""
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    ptr_a: int | None = None
    ptr_b: int | None = None
    count: int = 0
    rows: list[int] = field(default_factory=list)
    rows_total: int = 0
    elements: list[dict[str, Any]] = field(default_factory=list)
    a: Any = None
    b: Any = None

    @property
    def differs(self) -> bool:
        return self.status != "equal"

    @property
    def pointer_differs(self) -> bool:
        return (
            self.kind == "tensor"
            and None not in (self.ptr_a, self.ptr_b)
            and self.ptr_a != self.ptr_b
        )


def _differing_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[list[int], int, int]:
    """Leading indices where two same-shaped tensors differ (NaN equals NaN), and the counts."""
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    mask = ~same
    count = int(mask.sum())
    if a.dim() == 0:
        return [], 0, count
    rows = mask.reshape(mask.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
    return rows[:MAX_ROWS_LISTED], len(rows), count


def diff_dumps(a: LoadedDump, b: LoadedDump) -> list[FieldDiff]:
    """Every field of either dump, compared with :func:`planner.debug.diff_plans`."""
    out: list[FieldDiff] = []
    plans_a: dict[str, DumpedPlan] = {}
    plans_b: dict[str, DumpedPlan] = {}
    for backend in sorted(set(a.manifests) | set(b.manifests)):
        ma, mb = a.manifests.get(backend), b.manifests.get(backend)
        fa = ma.fields if ma else {}
        fb = mb.fields if mb else {}
        sa = ma.scalars if ma else {}
        sb = mb.scalars if mb else {}
        for name in list(fa) + [n for n in fb if n not in fa]:
            ra, rb = fa.get(name), fb.get(name)
            status = "equal" if ra and rb else ("only in A" if ra else "only in B")
            out.append(
                FieldDiff(
                    backend,
                    name,
                    "tensor",
                    status,
                    shape_a=ra.shape if ra else None,
                    shape_b=rb.shape if rb else None,
                    dtype_a=ra.dtype if ra else None,
                    dtype_b=rb.dtype if rb else None,
                    ptr_a=ra.data_ptr if ra else None,
                    ptr_b=rb.data_ptr if rb else None,
                )
            )
        for name in list(sa) + [n for n in sb if n not in sa]:
            status = (
                "equal"
                if name in sa and name in sb
                else ("only in A" if name in sa else "only in B")
            )
            out.append(FieldDiff(backend, name, "scalar", status, a=sa.get(name), b=sb.get(name)))
        if ma and mb:
            common = [n for n in fa if n in fb]
            common_scalars = [n for n in sa if n in sb]
            plans_a[backend] = DumpedPlan(ma, a.tensors[backend], common, common_scalars)
            plans_b[backend] = DumpedPlan(mb, b.tensors[backend], common, common_scalars)
    by_key = {(d.backend, d.field, d.kind): d for d in out}
    for mismatch in diff_plans(plans_a, plans_b):
        backend, name = mismatch.backend, mismatch.field
        kind = "tensor" if name in plans_a[backend].tensor_specs else "scalar"
        entry = by_key[(backend, name, kind)]
        entry.status = "differs"
        entry.reason = mismatch.reason
        if kind == "scalar":
            continue
        ta, tb = a.tensors[backend][name], b.tensors[backend][name]
        if ta.shape == tb.shape and ta.dtype == tb.dtype:
            entry.rows, entry.rows_total, entry.count = _differing_rows(ta, tb)
        entry.elements = [
            {"index": list(i), "a": json_value(x), "b": json_value(y)}
            for i, x, y in zip(mismatch.indices, mismatch.left, mismatch.right, strict=True)
        ]
    return out


def differing(diffs: list[FieldDiff], pointers: bool = False) -> list[FieldDiff]:
    """The entries that differ; with ``pointers``, equal contents at another data pointer
    too (two replays of one capture must share every pointer)."""
    return [d for d in diffs if d.differs or (pointers and d.pointer_differs)]


def diff_report(
    a: LoadedDump, b: LoadedDump, diffs: list[FieldDiff], pointers: bool = False
) -> dict[str, Any]:
    """The comparison as strict JSON data: both paths, the verdict, every field's entry."""
    differs = differing(diffs, pointers)
    return {
        "a": str(a.path),
        "b": str(b.path),
        "equal": not differs,
        "differing": [f"{d.backend}.{d.field}" for d in differs],
        "fields": [asdict(d) for d in diffs],
    }


def print_diff(
    a: LoadedDump | str | os.PathLike[str],
    b: LoadedDump | str | os.PathLike[str],
    *,
    pointers: bool = False,
    file: TextIO | None = None,
) -> list[FieldDiff]:
    """Compare two dumps (loaded, or paths: loaded and checked first), print the tables
    ``diff`` prints, and return the entries that differ (empty when the dumps are equal)."""
    a, b = as_loaded(a), as_loaded(b)
    diffs = diff_dumps(a, b)
    render_diff(a, b, diffs, make_console(file or sys.stdout), pointers)
    return differing(diffs, pointers)


def render_diff(
    a: LoadedDump,
    b: LoadedDump,
    diffs: list[FieldDiff],
    console: Console,
    pointers: bool = False,
) -> None:
    """The comparison as tables on ``console``: both dumps' titles, one table per backend
    (differing rows in red), then each differing tensor's elements and the verdict."""
    differs = differing(diffs, pointers)
    console.print(Text(f"A: {dump_title(a)}", style="bold"))
    console.print(Text(f"   {batch_text(a)}"))
    console.print(Text(f"B: {dump_title(b)}", style="bold"))
    console.print(Text(f"   {batch_text(b)}"))
    for backend in dict.fromkeys(d.backend for d in diffs):
        table = Table(title=backend, title_justify="left")
        for column in ("field", "shape A", "shape B", "dtype", "ptr A", "ptr B", "result"):
            table.add_column(column, no_wrap=column in ("field", "ptr A", "ptr B"))
        for d in (d for d in diffs if d.backend == backend):
            if d.kind == "scalar":
                cells = [
                    d.field,
                    f"= {fmt_value(d.a)}",
                    f"= {fmt_value(d.b)}",
                    "scalar",
                    "",
                    "",
                    _result(d, pointers),
                ]
            else:
                dtype = (
                    d.dtype_a
                    if d.dtype_a == d.dtype_b
                    else f"{fmt_value(d.dtype_a)} / {fmt_value(d.dtype_b)}"
                )
                ptr_a = "-" if d.ptr_a is None else hex(d.ptr_a)
                ptr_b = "-" if d.ptr_b is None else hex(d.ptr_b)
                if d.ptr_a is not None and d.ptr_a == d.ptr_b:
                    ptr_b = "same"
                cells = [
                    d.field,
                    shape_text(d.shape_a),
                    shape_text(d.shape_b),
                    fmt_value(dtype),
                    ptr_a,
                    ptr_b,
                    _result(d, pointers),
                ]
            style = "red" if d in differs else ""
            table.add_row(*(Text(c, style=style) for c in cells))
        console.print(table)
    for d in differs:
        if d.kind != "tensor" or not d.elements:
            continue
        console.print(Text(f"{d.backend}.{d.field}: {_result(d, pointers)}", style="bold red"))
        detail = Table(show_header=True, box=None, pad_edge=False)
        for column in ("index", "A", "B"):
            detail.add_column(column, justify="right")
        for element in d.elements:
            detail.add_row(
                Text(str(tuple(element["index"]))), Text(str(element["a"])), Text(str(element["b"]))
            )
        console.print(detail)
        if d.count > len(d.elements):
            console.print(Text(f"  ... {d.count - len(d.elements)} more differing elements"))
    if differs:
        names = ", ".join(f"{d.backend}.{d.field}" for d in differs)
        console.print(Text(f"{len(differs)} field(s) differ: {names}", style="bold red"))
    else:
        console.print(Text("dumps are equal", style="bold green"))


def _result(d: FieldDiff, pointers: bool) -> str:
    """The verdict cell: the reason and rows when contents differ."""
    if d.status == "equal":
        return "pointer differs" if pointers and d.pointer_differs else "equal"
    if d.status != "differs":
        return d.status
    if d.rows_total:
        rows = ", ".join(str(r) for r in d.rows)
        more = f", ... ({d.rows_total} rows)" if d.rows_total > len(d.rows) else ""
        return f"{d.reason}; rows {rows}{more}"
    return d.reason
