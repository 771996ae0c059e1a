"""``inspect`` and ``diff``: reading plan dumps from the command line.

``python -m planner inspect DIR`` shows what a kernel read (per backend, per
field: shape, dtype, device, data pointer, checksum, summary, first values);
``python -m planner diff A B`` shows what differs between two dumps, field by
field, down to the elements and rows, which is how a stale buffer is found:
the replayed plan differs from the eager one in exactly the rows a refresh
missed. Exit status: 0 equal (or inspected), 1 different, 2 error, so the
commands script well. Errors are one line on stderr, never a traceback.

Wire them into an argparse program with :func:`add_inspect_parser` and
:func:`add_diff_parser`; each sets ``func`` to a callable returning the exit
status. ``python -m serving.dump_cli`` runs them standalone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.dumps import DumpedPlan, FieldRecord, LoadedDump, json_value, load_dump
from planner.errors import PlanError
from planner.compare import diff_plans

MAX_ROWS_LISTED = 64
"""Differing rows named in a diff; the count is always exact."""


# ---- shared ----------------------------------------------------------------------------------


def _console(out: TextIO) -> Console:
    """A console that does not wrap piped output at 80 columns (it is read by scripts)."""
    wide = out.isatty() or "COLUMNS" in os.environ
    return Console(file=out, width=None if wide else 200, highlight=False, markup=False)


def _fail(command: str, exc: BaseException) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"planner {command}: error: {message}", file=sys.stderr)
    return 2


def _json_tree(value: Any) -> Any:
    """Nested lists from ``tolist()`` with non-finite floats made strict JSON."""
    if isinstance(value, list):
        return [_json_tree(v) for v in value]
    return json_value(value)


def _values(tensor: torch.Tensor) -> Any:
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float64)
    return _json_tree(tensor.tolist())


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _summary_text(record: FieldRecord) -> str:
    s = record.summary
    parts = [
        f"min {_fmt(s.min)}",
        f"max {_fmt(s.max)}",
        f"sum {_fmt(s.sum)}",
        f"nz {s.nonzero}/{s.count}",
    ]
    if s.nan is not None:
        parts.append(f"nan {s.nan}")
    return "  ".join(parts)


def _head_text(record: FieldRecord) -> str:
    more = ", ..." if record.summary.count > len(record.head) else ""
    return "[" + ", ".join(str(v) for v in record.head) + more + "]"


def _shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(str(d) for d in shape) + ")"


def _batch_text(dump: LoadedDump) -> str:
    batch = dump.batch
    if batch is None:
        return "batch: not recorded"
    s = batch.seq_lens
    return (
        f"batch: bs {batch.bs}, padded to {batch.padded_reqs}, next_n {batch.next_n}, "
        f"seq_lens min {s.min} max {s.max} sum {s.sum} head {s.head}"
    )


def _title(dump: LoadedDump) -> str:
    step = "-" if dump.step is None else dump.step
    label = f" '{dump.label}'" if dump.label else ""
    return f"{dump.path}{label}: step {step}, phase {dump.phase}, mode {dump.mode}"


# ---- inspect ---------------------------------------------------------------------------------


def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``inspect DIR [--field NAME] [--full] [--json]``; ``func`` returns the exit status."""
    parser = subparsers.add_parser(
        "inspect",
        help="show a plan dump: per field shape, dtype, pointer, checksum, summary",
        description="Show a plan dump written by planner.dumps (or a DumpRing / mismatch hook).",
    )
    parser.add_argument("dump", metavar="DIR", help="dump directory (holds dump.json)")
    parser.add_argument("--field", metavar="NAME", help="only this field: NAME or BACKEND.NAME")
    parser.add_argument("--full", action="store_true", help="print the full contents of the fields")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run_inspect)
    return parser


def _select(dump: LoadedDump, name: str | None) -> list[tuple[str, str]]:
    """``(backend, field)`` pairs that ``--field`` picks (all when None)."""
    every = [(b, f) for b, f, _, _ in dump.fields()]
    if name is None:
        return every
    picked = [(b, f) for b, f in every if name in (f, f"{b}.{f}")]
    if not picked:
        known = ", ".join(f"{b}.{f}" for b, f in every)
        raise PlanError(f"no field {name!r} in {dump.path} (fields: {known})")
    return picked


def run_inspect(args: argparse.Namespace) -> int:
    """Render one dump; 0 on success, 2 on a missing/corrupt dump or unknown field."""
    try:
        dump = load_dump(args.dump)
        selected = _select(dump, args.field)
    except (PlanError, OSError) as exc:
        return _fail("inspect", exc)
    if args.json:
        print(json.dumps(_inspect_json(dump, selected, args.full), indent=1, allow_nan=False))
    else:
        _inspect_render(dump, selected, args.full, args.field is not None, _console(sys.stdout))
    return 0


def _inspect_json(dump: LoadedDump, selected: list[tuple[str, str]], full: bool) -> dict[str, Any]:
    backends: dict[str, Any] = {}
    for backend, manifest in dump.manifests.items():
        names = [f for b, f in selected if b == backend]
        if not names:
            continue
        data = manifest.model_dump(mode="json")
        data["fields"] = {f: data["fields"][f] for f in names}
        if full:
            for f in names:
                data["fields"][f]["values"] = _values(dump.tensors[backend][f])
        backends[backend] = data
    return {
        "path": str(dump.path),
        "index": dump.index.model_dump(mode="json"),
        "backends": backends,
    }


def _inspect_render(
    dump: LoadedDump, selected: list[tuple[str, str]], full: bool, one: bool, console: Console
) -> None:
    console.print(Text(f"Plan dump {_title(dump)}", style="bold"))
    first = next(iter(dump.manifests.values()), None)
    if first is not None:
        console.print(Text(f"reqs {first.reqs} ({first.real_reqs} real); {_batch_text(dump)}"))
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
                        _shape(record.shape),
                        record.dtype,
                        record.device,
                        hex(record.data_ptr),
                        record.checksum if one else record.checksum[:12],
                        _summary_text(record),
                        _head_text(record),
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
        Text(f"{key} {_shape(list(tensor.shape))} {str(tensor.dtype).removeprefix('torch.')}:")
    )
    values = _values(tensor)
    if tensor.dim() <= 1:
        console.print(Text(f"  {values}"))
        return
    for i, row in enumerate(values):
        console.print(Text(f"  [{i}] {row}"))


# ---- diff ------------------------------------------------------------------------------------


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
    """Every field of either dump, compared with :func:`planner.compare.diff_plans`."""
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


def add_diff_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``diff A [B] [--pointers] [--json]``; ``func`` returns 0 equal, 1 different, 2 error."""
    parser = subparsers.add_parser(
        "diff",
        help="compare two plan dumps field by field",
        description=(
            "Compare two plan dumps field by field: shape, dtype, data pointer, differing "
            "elements with their indices and values, rows, scalars. With one argument, a "
            "mismatch directory: compares its replayed/ and eager/ dumps. "
            "Exit status 0 when equal, 1 when they differ, 2 on error."
        ),
    )
    parser.add_argument("a", metavar="A", help="first dump (or a mismatch-N directory)")
    parser.add_argument("b", metavar="B", nargs="?", help="second dump")
    parser.add_argument(
        "--pointers",
        action="store_true",
        help="count differing data pointers as a difference (two replays of one capture)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run_diff)
    return parser


def _pair(a: str, b: str | None) -> tuple[Path, Path]:
    if b is not None:
        return Path(a), Path(b)
    root = Path(a)
    if (root / "replayed").is_dir() and (root / "eager").is_dir():
        return root / "replayed", root / "eager"
    raise PlanError(
        f"diff needs two dumps, or one mismatch directory holding replayed/ and eager/: {root}"
    )


def run_diff(args: argparse.Namespace) -> int:
    """Compare two dumps; 0 equal, 1 different, 2 on error."""
    try:
        path_a, path_b = _pair(args.a, args.b)
        a, b = load_dump(path_a), load_dump(path_b)
    except (PlanError, OSError) as exc:
        return _fail("diff", exc)
    diffs = diff_dumps(a, b)
    pointers = getattr(args, "pointers", False)
    differs = [d for d in diffs if d.differs or (pointers and d.pointer_differs)]
    if args.json:
        report = {
            "a": str(a.path),
            "b": str(b.path),
            "equal": not differs,
            "differing": [f"{d.backend}.{d.field}" for d in differs],
            "fields": [asdict(d) for d in diffs],
        }
        print(json.dumps(report, indent=1, allow_nan=False))
    else:
        _diff_render(a, b, diffs, differs, pointers, _console(sys.stdout))
    return 1 if differs else 0


def _diff_render(
    a: LoadedDump,
    b: LoadedDump,
    diffs: list[FieldDiff],
    differs: list[FieldDiff],
    pointers: bool,
    console: Console,
) -> None:
    console.print(Text(f"A: {_title(a)}", style="bold"))
    console.print(Text(f"   {_batch_text(a)}"))
    console.print(Text(f"B: {_title(b)}", style="bold"))
    console.print(Text(f"   {_batch_text(b)}"))
    for backend in dict.fromkeys(d.backend for d in diffs):
        table = Table(title=backend, title_justify="left")
        for column in ("field", "shape A", "shape B", "dtype", "ptr A", "ptr B", "result"):
            table.add_column(column, no_wrap=column in ("field", "ptr A", "ptr B"))
        for d in (d for d in diffs if d.backend == backend):
            if d.kind == "scalar":
                cells = [
                    d.field,
                    f"= {_fmt(d.a)}",
                    f"= {_fmt(d.b)}",
                    "scalar",
                    "",
                    "",
                    _result(d, pointers),
                ]
            else:
                dtype = (
                    d.dtype_a
                    if d.dtype_a == d.dtype_b
                    else f"{_fmt(d.dtype_a)} / {_fmt(d.dtype_b)}"
                )
                ptr_a = "-" if d.ptr_a is None else hex(d.ptr_a)
                ptr_b = "-" if d.ptr_b is None else hex(d.ptr_b)
                if d.ptr_a is not None and d.ptr_a == d.ptr_b:
                    ptr_b = "same"
                cells = [
                    d.field,
                    _shape(d.shape_a),
                    _shape(d.shape_b),
                    _fmt(dtype),
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


# ---- standalone ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m serving.dump_cli {inspect,diff} ...``, until ``python -m planner`` wires them."""
    parser = argparse.ArgumentParser(prog="planner", description="Read plan dumps.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_inspect_parser(subparsers)
    add_diff_parser(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
